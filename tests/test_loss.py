"""Every loss against a plain, obviously correct reference: explicit softmax over small batches."""
import math

import pytest
import torch
import torch.nn.functional as F

from loss import ce_loss, contrastive_accuracy, cwt_loss, training_loss, unique_candidates



@pytest.fixture(autouse=True)
def float64_by_default():
    """References in float64, so the losses must agree with them to ~1e-12."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def naive_ce(h, weight, targets):
    total = 0.0
    for i in range(h.size(0)):
        logits = [float(h[i] @ weight[v]) for v in range(weight.size(0))]
        total += -logits[targets[i]] + math.log(sum(math.exp(s) for s in logits))
    return total / h.size(0)


def naive_cwt(h, e, temperature=1.0):
    """The paper's definition, written out: -log(exp(h_i.e_i) / sum_j exp(h_i.e_j)), all j in the batch."""
    total = 0.0
    for i in range(h.size(0)):
        scores = [float(h[i] @ e[j]) / temperature for j in range(e.size(0))]
        total += -math.log(math.exp(scores[i]) / sum(math.exp(s) for s in scores))
    return total / h.size(0)


def naive_cwt_unique(h, table, targets):
    """Candidates are the distinct target tokens: each token's embedding appears once."""
    distinct = sorted(set(targets.tolist()))
    total = 0.0
    for i in range(h.size(0)):
        scores = {t: float(h[i] @ table[t]) for t in distinct}
        total += -scores[int(targets[i])] + math.log(sum(math.exp(s) for s in scores.values()))
    return total / h.size(0)


def test_ce_matches_reference_and_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, generator=g, requires_grad=True)
    w = torch.randn(11, 5, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    assert ce_loss(h, w, t).item() == pytest.approx(naive_ce(h.detach(), w.detach(), t), abs=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: ce_loss(a, b, t), (h, w))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_cwt_matches_paper_definition(temperature):
    g = torch.Generator().manual_seed(1)
    h, e = torch.randn(9, 4, generator=g), torch.randn(9, 4, generator=g)
    got = cwt_loss(h, e, temperature).item()
    assert got == pytest.approx(naive_cwt(h, e, temperature), abs=1e-12)


def test_cwt_gradients_flow_into_both_sides():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 3, generator=g, requires_grad=True)
    e = torch.randn(6, 3, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: cwt_loss(a, b), (h, e))
    cwt_loss(h, e).backward()
    assert h.grad.abs().sum() > 0 and e.grad.abs().sum() > 0


def test_cwt_keeps_repeated_tokens_as_negatives():
    # Two rows share a target token: the paper keeps the copy as a (false) negative, so a perfect
    # alignment cannot push the loss below log(2) for those rows.
    table = torch.eye(3) * 50
    t = torch.tensor([0, 0, 1, 2])
    h = table[t].clone()
    per_row = [math.log(2), math.log(2), 0.0, 0.0]
    assert cwt_loss(h, table[t]).item() == pytest.approx(sum(per_row) / 4, abs=1e-6)
    assert cwt_loss(h, table[t], targets=t, negatives="unique").item() == pytest.approx(0.0, abs=1e-6)


def test_cwt_finite_for_huge_scores_in_float32_and_bfloat16():
    # The official implementation computes exp(scores) and overflows above ~88 in fp32.
    g = torch.Generator().manual_seed(3)
    h64, e64 = torch.randn(8, 16, generator=g) * 40, torch.randn(8, 16, generator=g) * 40
    expected = naive_cwt_stable(h64, e64)
    for dtype, tol in [(torch.float32, 1e-3), (torch.bfloat16, 0.05)]:
        got = cwt_loss(h64.to(dtype), e64.to(dtype))
        assert got.dtype == torch.float32 and torch.isfinite(got)
        assert got.item() == pytest.approx(expected, rel=tol)


def naive_cwt_stable(h, e):
    s = h @ e.T
    return float((torch.logsumexp(s, 1) - s.diag()).mean())


def test_losses_are_fp32_under_autocast():
    h, w = torch.randn(4, 8, dtype=torch.float32), torch.randn(10, 8, dtype=torch.float32)
    t = torch.tensor([1, 2, 3, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ce_loss(h, w, t).dtype == torch.float32
        assert cwt_loss(h, w[t]).dtype == torch.float32


def test_unique_negatives_match_reference_and_gradients():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(5, 4, generator=g, requires_grad=True)
    t = torch.tensor([3, 1, 3, 0, 1, 1, 4])
    h = torch.randn(7, 4, generator=g, requires_grad=True)
    got = cwt_loss(h, table[t], targets=t, negatives="unique")
    assert got.item() == pytest.approx(naive_cwt_unique(h.detach(), table.detach(), t), abs=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: cwt_loss(a, b[t], targets=t, negatives="unique"), (h, table))


def test_unique_candidates_picks_each_token_once():
    t = torch.tensor([5, 2, 5, 9, 2])
    e = torch.arange(5.0)[:, None].repeat(1, 2)  # row i holds i, to see which rows were picked
    cand, labels = unique_candidates(e, t)
    assert cand[:, 0].tolist() == [1.0, 0.0, 3.0]  # first occurrences of tokens 2, 5, 9
    assert labels.tolist() == [1, 0, 1, 2, 0]


def naive_sampled(h, e, labels, drawn):
    total = 0.0
    for i in range(h.size(0)):
        candidates = [int(labels[i])] + [int(j) for j in drawn if int(j) != int(labels[i])]
        scores = [float(h[i] @ e[j]) for j in candidates]
        total += -scores[0] + math.log(sum(math.exp(s) for s in scores))
    return total / h.size(0)


@pytest.mark.parametrize("negatives", ["all", "unique"])
def test_subset_of_negatives_matches_reference(negatives):
    g = torch.Generator().manual_seed(5)
    table = torch.randn(6, 4, generator=g)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 2, 5])
    h = torch.randn(10, 4, generator=g)
    k = 3
    got = cwt_loss(h, table[t], targets=t, negatives=negatives, num_negatives=k,
                   generator=torch.Generator().manual_seed(7))
    if negatives == "unique":
        cand, labels = table[torch.unique(t)], torch.unique(t, return_inverse=True)[1]
    else:
        cand, labels = table[t], torch.arange(10)
    drawn = torch.randperm(cand.size(0), generator=torch.Generator().manual_seed(7))[:k]
    assert got.item() == pytest.approx(naive_sampled(h, cand, labels, drawn), abs=1e-12)


def test_subset_is_deterministic_with_a_seeded_generator():
    h, e = torch.randn(20, 4), torch.randn(20, 4)
    a = cwt_loss(h, e, num_negatives=5, generator=torch.Generator().manual_seed(0))
    b = cwt_loss(h, e, num_negatives=5, generator=torch.Generator().manual_seed(0))
    assert a.item() == b.item()
    # asking for at least as many negatives as there are rows is the full loss
    assert cwt_loss(h, e, num_negatives=50).item() == pytest.approx(cwt_loss(h, e).item(), abs=1e-12)


def test_contrastive_accuracy_counts_repeats_as_correct():
    table = torch.eye(3)
    t = torch.tensor([0, 0, 1, 2])
    h = torch.stack([table[0], table[0], table[2], table[2]])  # row 2 prefers token 2: wrong
    assert contrastive_accuracy(h, table[t], t).item() == pytest.approx(0.75)


def test_training_loss_selects_objectives():
    g = torch.Generator().manual_seed(6)
    E, W = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    h = torch.randn(2, 3, 4, generator=g)
    t = torch.randint(0, 12, (2, 3), generator=g)
    hf, tf = h.reshape(6, 4), t.reshape(6)
    ce, cwt = naive_ce(hf, E, tf), naive_cwt(hf, E[tf])
    assert training_loss(h, t, E, E, "ce").item() == pytest.approx(ce, abs=1e-12)
    assert training_loss(h, t, E, E, "cwt").item() == pytest.approx(cwt, abs=1e-12)
    assert training_loss(h, t, E, E, "ce+cwt").item() == pytest.approx(ce + cwt, abs=1e-12)
    # nce: contrastive against the separate output table, not the input embeddings
    assert training_loss(h, t, E, W, "nce").item() == pytest.approx(naive_cwt(hf, W[tf]), abs=1e-12)
    with pytest.raises(ValueError):
        training_loss(h, t, E, E, "mse")


# ----------------------------------------------------------------------------------------------
# Chunked (memory-flat) paths: the same values and gradients as the plain ones


@pytest.fixture
def narrow_tiles(monkeypatch):
    """Tiles 4 candidates wide, so the streaming logsumexp across column blocks is exercised too."""
    import loss
    monkeypatch.setattr(loss, "TILE_COLUMNS", 4)


def loss_and_grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    value = fn(*inputs)
    return value.detach(), torch.autograd.grad(value, inputs, allow_unused=True, materialize_grads=True)


CHUNKED_CASES = [  # (objective, negatives, num_negatives)
    ("ce", "all", None), ("cwt", "all", None), ("cwt", "unique", None), ("cwt", "all", 4),
    ("cwt", "unique", 3), ("cwt", "all", 1), ("ce+cwt", "all", None), ("nce", "unique", None)]


@pytest.mark.parametrize("objective,negatives,k", CHUNKED_CASES)
@pytest.mark.parametrize("chunk_size", [1, 5, 64])  # 5 does not divide 13 rows; 64 is one block
@pytest.mark.parametrize("scale,temperature", [(1.0, 1.0), (1.0, 0.3), (100.0, 2.0)])
def test_chunked_training_loss_equals_plain(narrow_tiles, objective, negatives, k, chunk_size, scale,
                                            temperature):
    g = torch.Generator().manual_seed(11)
    E, W = torch.randn(9, 4, generator=g) * scale, torch.randn(9, 4, generator=g) * scale
    h = torch.randn(13, 4, generator=g) * scale  # scale 100: scores ~1e4, softmax almost one-hot
    t = torch.randint(0, 9, (13,), generator=g)

    def run(chunk):
        return lambda h, E, W: training_loss(h, t, E, W, objective, temperature, negatives, k,
                                             torch.Generator().manual_seed(3), chunk_size=chunk)
    want, want_grads = loss_and_grads(run(None), h, E, W)
    got, got_grads = loss_and_grads(run(chunk_size), h, E, W)
    assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_core_gradcheck_with_labels_at_an_offset(narrow_tiles):
    # The core takes any candidate set larger than the rows (e.g. negatives gathered from other ranks)
    from loss import chunked_cross_entropy
    g = torch.Generator().manual_seed(12)
    h = torch.randn(6, 3, generator=g, requires_grad=True)
    cand = torch.randn(11, 3, generator=g, requires_grad=True)
    labels = torch.arange(6) + 5
    got = chunked_cross_entropy(h, cand, labels, temperature=0.7, chunk_size=4)
    assert got.item() == pytest.approx(naive_ce(h.detach() / 0.7, cand.detach(), labels), abs=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, labels, 0.7, 4), (h, cand))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(h, cand, labels, chunk_size=0)


def test_chunked_tiles_cover_every_score_once_within_the_budget():
    from loss import TILE_COLUMNS, _tiles
    # CE (V >> N): blocks span every row, so each slice of the candidates' gradient is one matmul
    assert next(_tiles(2048, 50304, 256)) == (slice(0, 2048), slice(0, 4096))
    # CWT (M = N): blocks of chunk_size rows against every candidate
    assert next(_tiles(8192, 8192, 1024)) == (slice(0, 1024), slice(0, 8192))
    for n, m, chunk in [(13, 40, 1), (13, 40, 5), (6, 11, 64), (13, 9, 5), (100, 40000, 2)]:
        count = torch.zeros(n, m, dtype=torch.int32)
        for rows, cols in _tiles(n, m, chunk):
            assert count[rows, cols].numel() <= chunk * min(m, TILE_COLUMNS)
            count[rows, cols] += 1
        assert bool((count == 1).all()), (n, m, chunk)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])  # blocks of 1 row (budget 4 < 5 rows), all 5 rows
@pytest.mark.parametrize("scale,temperature", [(1.0, 1.0), (100.0, 0.3)])
def test_chunked_more_candidates_than_rows_equals_plain(narrow_tiles, chunk_size, scale, temperature):
    # CE's shape (V > N), where blocks span the rows, with some candidates excluded per row
    from loss import chunked_row_losses
    g = torch.Generator().manual_seed(15)
    h, cand = torch.randn(5, 4, generator=g) * scale, torch.randn(23, 4, generator=g) * scale
    labels, exclude = torch.tensor([0, 22, 7, 7, 13]), torch.tensor([3, -1, 22, 8, -1])
    weights = torch.rand(5, generator=g)  # unequal row gradients, as in the sampled-negatives path

    def chunked(h, cand):
        return (chunked_row_losses(h, cand, labels, temperature, chunk_size, exclude) * weights).sum()

    def plain(h, cand):
        s = (h @ cand.T / temperature).masked_fill(exclude[:, None] == torch.arange(23)[None, :], -math.inf)
        return (F.cross_entropy(s, labels, reduction="none") * weights).sum()
    want, want_grads = loss_and_grads(plain, h, cand)
    got, got_grads = loss_and_grads(chunked, h, cand)
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("objective", ["ce", "cwt"])
def test_chunked_under_bfloat16_autocast_is_fp32_and_matches_plain(objective):
    g = torch.Generator().manual_seed(13)
    E = torch.randn(50, 32, generator=g, dtype=torch.float32)
    h = torch.randn(40, 32, generator=g, dtype=torch.float32) * 3
    t = torch.randint(0, 50, (40,), generator=g)

    def run(chunk):
        def fn(h, E):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return training_loss(h, t, E, E, objective, chunk_size=chunk)
        return fn
    want, want_grads = loss_and_grads(run(None), h, E)
    got, got_grads = loss_and_grads(run(16), h, E)
    # the same bf16 scores, summed in fp32 in another order
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == torch.float32
        # bf16 matmuls of the gradient: plain rounds each product to bf16, chunked adds blocks in fp32
        torch.testing.assert_close(a, b, rtol=0, atol=0.01 * float(b.abs().max()))


def test_chunked_cwt_runs_under_torch_compile():
    g = torch.Generator().manual_seed(14)
    E = torch.randn(30, 8, generator=g, dtype=torch.float32)
    h = torch.randn(20, 8, generator=g, dtype=torch.float32)
    t = torch.randint(0, 30, (20,), generator=g)
    fn = lambda h, E: training_loss(h, t, E, E, "cwt", chunk_size=8)  # noqa: E731
    want, want_grads = loss_and_grads(fn, h, E)
    try:  # fullgraph: the chunked Function must trace without graph breaks
        got, got_grads = loss_and_grads(torch.compile(fn, fullgraph=True), h, E)
    except Exception as e:  # the backend failed (no C compiler, say): not this code's concern
        if not type(e).__module__.startswith("torch._inductor"):
            raise
        pytest.skip(f"torch.compile's backend is unavailable here: {type(e).__name__}")
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

"""Every loss against a plain, obviously correct reference: explicit softmax over small batches."""
import math

import pytest
import torch

from loss import LossConfig, ce_cwt_loss, ce_loss, contrastive_accuracy, cwt_loss, nce_loss, training_loss


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


def test_contrastive_accuracy_counts_repeats_as_correct():
    table = torch.eye(3)
    t = torch.tensor([0, 0, 1, 2])
    h = torch.stack([table[0], table[0], table[2], table[2]])  # row 2 prefers token 2: wrong
    assert contrastive_accuracy(h, table[t], t).item() == pytest.approx(0.75)
    for chunk in (1, 3):  # rows scored a few at a time give the same answer
        assert contrastive_accuracy(h, table[t], t, chunk_size=chunk).item() == pytest.approx(0.75)


def test_training_loss_selects_objectives():
    g = torch.Generator().manual_seed(6)
    E, W = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    h = torch.randn(2, 3, 4, generator=g)
    t = torch.randint(0, 12, (2, 3), generator=g)
    hf, tf = h.reshape(6, 4), t.reshape(6)
    ce, cwt = naive_ce(hf, E, tf), naive_cwt(hf, E[tf])
    assert training_loss(h, t, E, E, LossConfig(loss="ce")).item() == pytest.approx(ce, abs=1e-12)
    assert training_loss(h, t, E, E, LossConfig(loss="cwt")).item() == pytest.approx(cwt, abs=1e-12)
    assert training_loss(h, t, E, E, LossConfig(loss="ce+cwt")).item() == pytest.approx(ce + cwt, abs=1e-12)
    # nce: contrastive against the separate output table, not the input embeddings
    assert training_loss(h, t, E, W, LossConfig(loss="nce")).item() == pytest.approx(naive_cwt(hf, W[tf]), abs=1e-12)
    # the ablations are plain functions too
    assert ce_cwt_loss(hf, E, E, tf).item() == pytest.approx(ce + cwt, abs=1e-12)
    assert nce_loss(hf, W, tf).item() == pytest.approx(naive_cwt(hf, W[tf]), abs=1e-12)
    with pytest.raises(ValueError):
        training_loss(h, t, E, E, LossConfig(loss="mse"))
    with pytest.raises(ValueError, match="negatives.training_loss_with_negatives"):  # the extra's: never imported here
        training_loss(h, t, E, E, LossConfig(negatives="unique"))


@pytest.mark.parametrize("t0", [1.0, 0.4])
def test_a_tensor_temperature_gets_the_gradient_of_the_definition_also_at_one(t0):
    """A learnable temperature that starts at exactly 1 trains: its gradient is the naive loss's, by finite
    differences of naive_cwt (the division is skipped only for the number 1)."""
    g = torch.Generator().manual_seed(8)
    h, e = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    t = torch.tensor(t0, requires_grad=True)
    loss = cwt_loss(h, e, t)
    loss.backward()
    step = 1e-6
    numeric = (naive_cwt(h, e, t0 + step) - naive_cwt(h, e, t0 - step)) / (2 * step)
    assert loss.item() == pytest.approx(naive_cwt(h, e, t0), abs=1e-12)
    assert t.grad.item() == pytest.approx(numeric, rel=1e-6) and t.grad.item() != 0.0
    assert torch.autograd.gradcheck(lambda a, b, c: cwt_loss(a, b, c), (h.requires_grad_(), e, t))


def test_a_metric_of_no_rows_is_none_and_a_non_finite_one_is_named_where_it_is_computed():
    """loss.val_metrics is the one place a validation metric's rule lives: a mean over no rows (a split whose
    targets are all special ids, for bits per byte) is None, not a divergence; NaN or inf raises NotFinite naming
    the metric."""
    from loss import NotFinite, val_metrics
    sums = {"ce": 6.0, "tokens": 3.0, "cwt": 3.0, "correct": 1.0, "text_ce": 0.0, "bytes": 0.0}
    got = val_metrics(sums, contrastive=True, bits_per_byte=True)
    assert got == {"val_ce": 2.0, "val_ppl": pytest.approx(math.exp(2)), "val_cwt": 1.0,
                   "val_acc": pytest.approx(1 / 3), "val_bpb": None}
    for key, name in (("ce", "val_ce"), ("cwt", "val_cwt"), ("text_ce", "val_bpb")):
        with pytest.raises(NotFinite, match=f"{name} is nan") as e:
            val_metrics({**sums, key: math.nan, "bytes": 2.0}, contrastive=True, bits_per_byte=True)
        assert e.value.name == name


def test_a_mix_averages_each_metric_over_the_sources_that_have_it():
    from mixing import MixedSampler
    per_source = {"a": {"val_ce": 2.0, "val_ppl": 7.4, "val_bpb": None}, "b": {"val_ce": 4.0, "val_ppl": 55.0,
                                                                          "val_bpb": 1.5}}
    got = MixedSampler.combine(None, per_source)
    assert got["val_ce"] == 3.0 and got["val_ppl"] == pytest.approx(math.exp(3.0)) and got["val_bpb"] == 1.5
    assert got["val_bpb_a"] is None and got["val_bpb_b"] == 1.5
    none = MixedSampler.combine(None, {"a": {"val_ce": 1.0, "val_ppl": 2.7, "x": None}})
    assert none["x"] is None

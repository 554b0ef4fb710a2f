"""chunked.py, the memory-flat losses: the same values and gradients as the plain ones."""
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config
from hypothesis import HealthCheck, given, settings, strategies as st
from test_loss import float64_by_default, naive_ce  # noqa: F401  (the fixture applies to this file too)
from torch.utils._python_dispatch import TorchDispatchMode

import chunked
import train
from common import UserError
from loss import LossConfig


def rounding_tolerance(h, candidates, temperature):
    """How far two correct float64 computations may differ. The scores' absolute rounding error is about
    eps x |score|, and it depends on the BLAS kernel's summation order (CPUs differ); a softmax passes it on
    as relative error of the loss and its gradients. Near-one-hot scores of 1e5 thus allow ~1e-8, not 1e-10."""
    largest = (h @ candidates.T).abs().max().item() / temperature
    return 1024 * torch.finfo(torch.float64).eps * max(largest, 1.0)


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
def test_chunked_training_loss_equals_plain(objective, negatives, k, chunk_size, scale,
                                            temperature):
    g = torch.Generator().manual_seed(11)
    E, W = torch.randn(9, 4, generator=g) * scale, torch.randn(9, 4, generator=g) * scale
    h = torch.randn(13, 4, generator=g) * scale  # scale 100: scores ~1e4, softmax almost one-hot
    t = torch.randint(0, 9, (13,), generator=g)

    def run(chunk):
        config = LossConfig(loss=objective, temperature=temperature, negatives=negatives, num_negatives=k,
                            loss_chunk_size=chunk or 0)
        return lambda h, E, W: train.objective_loss(h, t, E, W, config, torch.Generator().manual_seed(3))
    want, want_grads = loss_and_grads(run(None), h, E, W)
    got, got_grads = loss_and_grads(run(chunk_size), h, E, W)
    tol = rounding_tolerance(h, torch.cat([E, W]), temperature)
    assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


def test_chunked_core_gradcheck_with_labels_at_an_offset():
    # The core takes any candidate set larger than the rows (e.g. negatives gathered from other ranks)
    g = torch.Generator().manual_seed(12)
    h = torch.randn(6, 3, generator=g, requires_grad=True)
    cand = torch.randn(11, 3, generator=g, requires_grad=True)
    labels = torch.arange(6) + 5
    got = chunked.chunked_cross_entropy(h, cand, labels, temperature=0.7, chunk_size=4)
    assert got.item() == pytest.approx(naive_ce(h.detach() / 0.7, cand.detach(), labels), abs=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: chunked.chunked_cross_entropy(a, b, labels, 0.7, 4), (h, cand))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked.chunked_cross_entropy(h, cand, labels, chunk_size=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])  # blocks of 1 row, of 3 (5 rows: a short last one), all
@pytest.mark.parametrize("scale,temperature", [(1.0, 1.0), (100.0, 0.3)])
def test_chunked_row_losses_take_any_row_weights(chunk_size, scale, temperature):
    # chunked_row_losses (per row, recomputed in the backward): unequal row gradients, V > N as in CE, some
    # candidates excluded per row
    g = torch.Generator().manual_seed(15)
    h, cand = torch.randn(5, 4, generator=g) * scale, torch.randn(23, 4, generator=g) * scale
    labels, exclude = torch.tensor([0, 22, 7, 7, 13]), torch.tensor([3, -1, 22, 8, -1])
    weights = torch.rand(5, generator=g)

    def in_chunks(h, cand):
        return (chunked.chunked_row_losses(h, cand, labels, temperature, chunk_size, exclude) * weights).sum()

    def plain(h, cand):
        s = (h @ cand.T / temperature).masked_fill(exclude[:, None] == torch.arange(23)[None, :], -math.inf)
        return (F.cross_entropy(s, labels, reduction="none") * weights).sum()
    want, want_grads = loss_and_grads(plain, h, cand)
    got, got_grads = loss_and_grads(in_chunks, h, cand)
    tol = rounding_tolerance(h, cand, temperature)
    assert got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


def plain_softmax_loss(h, candidates, temperature, labels=None, positives=None, exclude=None):
    """chunked_softmax_loss's reference: every score at once, the positive as column 0 if given apart."""
    s = h @ candidates.T / temperature
    if exclude is not None:
        s = s.masked_fill(exclude[:, None] == torch.arange(s.size(1))[None, :], -math.inf)
    if positives is None:
        return F.cross_entropy(s, labels)
    s = torch.cat([(h * positives).sum(1, keepdim=True) / temperature, s], dim=1)
    return F.cross_entropy(s, torch.zeros(h.size(0), dtype=torch.long))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 9), m=st.integers(1, 7), chunk_size=st.integers(1, 10), own_positive=st.booleans(),
       scale=st.sampled_from([0.1, 1.0, 100.0]), temperature=st.sampled_from([1.0, 0.3, 2.0]),
       seed=st.integers(0, 2**16))
def test_chunked_softmax_loss_equals_plain_for_any_shape(n, m, chunk_size, own_positive, scale, temperature, seed):
    # (the float64 fixture only sets the default dtype: sharing it across examples is harmless)
    # Any rows, candidates and block size; positives among the candidates (labels) or apart (sampled
    # negatives, a drawn copy of the positive excluded: with m = 1, rows with every candidate excluded);
    # scale 100 makes scores ~1e4 that would overflow exp() unless shifted
    g = torch.Generator().manual_seed(seed)
    h, cand = torch.randn(n, 3, generator=g) * scale, torch.randn(m, 3, generator=g) * scale
    exclude = torch.randint(-1, m, (n,), generator=g)
    if own_positive:
        inputs, kw = (h, cand, torch.randn(n, 3, generator=g) * scale), {}
    else:
        inputs, kw = (h, cand), {"labels": torch.randint(0, m, (n,), generator=g)}
        exclude = torch.where(exclude == kw["labels"], -1, exclude)  # never the positive itself

    def run(fn):
        def loss(h, cand, positives=None):
            return fn(h, cand, temperature, positives=positives, exclude=exclude, **kw)
        return loss
    want, want_grads = loss_and_grads(run(plain_softmax_loss), *inputs)
    got, got_grads = loss_and_grads(run(lambda *a, **k: chunked.chunked_softmax_loss(*a, chunk_size, **k)),
                                    *inputs)
    tol = rounding_tolerance(h, torch.cat(inputs[1:]), temperature)
    assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


class CountMatmuls(TorchDispatchMode):
    """Counts the matmul FLOPs (2 m n k each) of every op run under it, forward and backward, and the
    largest tensor any op makes; a matmul-like op it cannot count is recorded in `unknown`."""
    COUNTED = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2)}  # op name: positions of its two factors
    OTHERS = {"bmm", "baddbmm", "matmul", "dot", "vdot", "mv", "addmv", "linear", "einsum", "_scaled_mm"}

    def __init__(self):
        super().__init__()
        self.flops, self.largest, self.unknown = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.COUNTED:
            a, b = (args[i] for i in self.COUNTED[name])
            self.flops += 2 * a.size(0) * a.size(1) * b.size(1)
        elif name in self.OTHERS:
            self.unknown.append(name)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def matmuls_and_largest(fn, *inputs, forward_only=False):
    """(matmuls of N x M x d each, largest tensor made) over fn's forward and backward."""
    with CountMatmuls() as counter:
        value = fn(*inputs)
        if not forward_only:
            value.backward()
    assert not counter.unknown
    return counter.flops / (2 * inputs[0].size(0) * inputs[1].size(0) * inputs[0].size(1)), counter.largest


@pytest.mark.parametrize("n,m", [(64, 64), (24, 200)])  # CWT's shape (M = N) and CE's (V > N)
def test_chunked_gradients_cost_three_matmuls_and_no_n_by_m_tensor(n, m):
    g = torch.Generator().manual_seed(16)
    h, cand = torch.randn(n, 4, generator=g), torch.randn(m, 4, generator=g)  # d = 4: blocks of scores are
    labels = torch.randint(0, m, (n,), generator=g)  # the largest tensors, 8 x M, where N x M would be plain's

    def ce(h, cand):
        return chunked.chunked_cross_entropy(h, cand, labels, 0.5, chunk_size=8)

    def sampled(h, cand, positives):
        return chunked.chunked_softmax_loss(h, cand, 0.5, 8, positives=positives, exclude=labels)

    def per_row(h, cand):
        return chunked.chunked_row_losses(h, cand, labels, 0.5, 8).sum()
    both = (h.clone().requires_grad_(), cand.clone().requires_grad_())
    positives = torch.randn(n, 4, generator=g, requires_grad=True)
    # scores, h's gradient, the candidates' gradient; all three in the forward, none in the backward
    assert matmuls_and_largest(ce, *both) == (3, 8 * m)
    assert matmuls_and_largest(ce, *both, forward_only=True)[0] == 3
    assert matmuls_and_largest(sampled, *both, positives) == (3, 8 * m)
    # no gradient wanted: the scores alone
    with torch.no_grad():
        assert matmuls_and_largest(ce, *both, forward_only=True)[0] == 1
        assert matmuls_and_largest(sampled, *both, positives, forward_only=True)[0] == 1
    assert matmuls_and_largest(ce, h, cand, forward_only=True)[0] == 1
    assert matmuls_and_largest(ce, h, both[1])[0] == 2  # the candidates' gradient only
    # per-row losses under any weights: the backward recomputes the scores
    assert matmuls_and_largest(per_row, *both) == (4, 8 * m)


def test_chunked_softmax_loss_needs_one_kind_of_positive():
    h = torch.randn(3, 2)
    with pytest.raises(ValueError, match="either as labels or as positives"):
        chunked.chunked_softmax_loss(h, h, 1.0, 2, labels=torch.arange(3), positives=h)


@pytest.mark.parametrize("objective,k", [("ce", None), ("cwt", None), ("cwt", 7)])
def test_chunked_under_bfloat16_autocast_is_fp32_and_matches_plain(objective, k):
    g = torch.Generator().manual_seed(13)
    E = torch.randn(50, 32, generator=g, dtype=torch.float32)
    h = torch.randn(40, 32, generator=g, dtype=torch.float32) * 3
    t = torch.randint(0, 50, (40,), generator=g)

    def run(chunk):
        def fn(h, E):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                config = LossConfig(loss=objective, num_negatives=k, loss_chunk_size=chunk or 0)
                return train.objective_loss(h, t, E, E, config, torch.Generator().manual_seed(3))
        return fn
    want, want_grads = loss_and_grads(run(None), h, E)
    got, got_grads = loss_and_grads(run(16), h, E)
    # the same bf16 scores, summed in fp32 in another order
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == torch.float32
        # bf16 matmuls of the gradient: plain rounds each product to bf16, chunked adds blocks in fp32
        torch.testing.assert_close(a, b, rtol=0, atol=0.01 * float(b.abs().max()))


@pytest.mark.parametrize("case", ["cwt", "sampled"])
def test_chunked_compiles_whole(case):
    # fullgraph: the chunked Functions trace without graph breaks; aot_eager traces their forward and
    # backward into one joint graph, as inductor would, without needing a C compiler
    g = torch.Generator().manual_seed(14)
    E = torch.randn(30, 8, generator=g, dtype=torch.float32)
    h = torch.randn(20, 8, generator=g, dtype=torch.float32)
    t = torch.randint(0, 30, (20,), generator=g)
    drawn = torch.randperm(30, generator=g)[:6]  # sampled_loss draws outside (randperm with a generator breaks)
    slot = torch.full((30,), -1).index_put_((drawn,), torch.arange(6))

    def fn(h, E):
        if case == "cwt":
            return train.objective_loss(h, t, E, E, LossConfig(loss="cwt", loss_chunk_size=8))
        return chunked.chunked_softmax_loss(h, E[drawn], 0.7, 8, positives=E[t], exclude=slot[t])
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    want, want_grads = loss_and_grads(fn, h, E)
    got, got_grads = loss_and_grads(compiled, h, E)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # the gradient-free variant (validation) compiles too
        assert compiled(h, E).item() == pytest.approx(want.item(), rel=1e-6)


def test_the_tolerance_covers_another_cpus_rounding_and_nothing_more():
    # The case that failed on an AVX-512 Xeon (test above, scale 100, temperature 0.3, one-row blocks): its
    # gradients differed by 4.1e-10 relative where 1e-10 was allowed, because that CPU's BLAS sums in
    # another order. The tolerance now follows from the scores' size, and still rejects real errors.
    g = torch.Generator().manual_seed(15)
    h, cand = torch.randn(5, 4, generator=g) * 100, torch.randn(23, 4, generator=g) * 100
    tol = rounding_tolerance(h, cand, 0.3)
    assert 4.1e-10 < tol < 1e-6
    assert rounding_tolerance(h / 100, cand / 100, 1.0) < 1e-11  # ordinary scores keep a tight bound


@pytest.mark.usefixtures("small_tiny_preset")
def test_loss_chunk_size_trains_like_the_plain_loss(tiny_data_dir, tmp_path):
    # ce+cwt: both chunked paths; 8 x 32 = 256 rows in chunks of 100, CE's 50304 columns in 2 tiles
    runs = {chunk: train.train(tiny_config(tiny_data_dir, tmp_path / str(chunk), loss="ce+cwt", max_iters=3,
                                           eval_interval=3, loss_chunk_size=chunk)) for chunk in (0, 100)}
    assert runs[100]["loss"] == pytest.approx(runs[0]["loss"], rel=1e-4)
    with pytest.raises(UserError, match=r"--loss_chunk_size must be in \[0, 1073741824\]"):
        train.train(tiny_config(tiny_data_dir, tmp_path / "bad", loss_chunk_size=-1))


def test_chunked_validation_gives_the_same_figures(tiny_data_dir):
    import data
    from model import build_model

    torch.manual_seed(0)
    model = build_model("tiny", 50304, block_size=32)
    val = data.open_val_split(tiny_data_dir, 50304)
    runs = [train.evaluate(train.Objective(model, LossConfig(loss="cwt", loss_chunk_size=chunk)), val,
                           train.Validation(batch_size=4, block_size=32, max_batches=2))
            for chunk in (0, 7)]
    assert set(runs[0]) == {"val_ce", "val_ppl", "val_cwt", "val_acc", "val_bpb"}
    for key in runs[0]:
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-5), key


def test_bench_times_another_chunked_py_beside_this_one(tmp_path):
    import bench

    ref = tmp_path / "chunked.py"  # a stand-in that records its calls
    ref.write_text("import torch.nn.functional as F\n\nCALLS = []\n\n\n"
                   "def chunked_cross_entropy(h, candidates, labels, temperature=1.0, chunk_size=1024):\n"
                   "    CALLS.append(chunk_size)\n"
                   "    return F.cross_entropy(h @ candidates.T / temperature, labels)\n")
    cfg = bench.BenchConfig(mode="loss", preset="tiny", vocab=[512], tokens=[64], variants=["cwt", "cwt-chunk16"],
                            repeats=1, warmup=0, memory=False, chunked_ref=str(ref))
    rows = bench.run_bench(cfg)["rows"]
    assert [r["variant"] for r in rows] == ["cwt", "cwt-chunk16", "cwt-chunk16@ref"]
    assert bench.reference_chunked(str(ref)).CALLS == [16]  # the @ref row ran the stand-in, once
    assert sys.modules["chunked"] is chunked  # and the usual module is back
    with pytest.raises(UserError, match="--chunked_ref=.* is not a file"):
        bench.check_config(bench.BenchConfig(chunked_ref=str(tmp_path / "missing.py")))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), m=st.integers(1, 7), chunk_size=st.integers(1, 10), own_positive=st.booleans(),
       t0=st.sampled_from([1.0, 0.3, 2.0]), seed=st.integers(0, 2**16))
def test_a_tensor_temperature_gets_the_plain_losses_gradient(n, m, chunk_size, own_positive, t0, seed):
    """A learnable temperature through the chunked loss: the value and every gradient, the temperature's among
    them (made in the sweep, from h's: dL/dt = -(h . dL/dh) / t), are the plain loss's, in float64."""
    g = torch.Generator().manual_seed(seed)
    h, cand = torch.randn(n, 3, generator=g), torch.randn(m, 3, generator=g)
    t = torch.tensor(t0)
    if own_positive:
        inputs, kw = (h, cand, t, torch.randn(n, 3, generator=g)), {}
    else:
        inputs, kw = (h, cand, t), {"labels": torch.randint(0, m, (n,), generator=g)}

    def run(fn):
        def loss(h, cand, t, positives=None):
            return fn(h, cand, t, positives=positives, **kw)
        return loss
    want, want_grads = loss_and_grads(run(plain_softmax_loss), *inputs)
    got, got_grads = loss_and_grads(run(lambda *a, **k: chunked.chunked_softmax_loss(*a, chunk_size, **k)), *inputs)
    tol = rounding_tolerance(h, cand, t0)
    assert got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
    weights = torch.arange(1.0, n + 1)  # any weighting of the rows: the recomputed backward of the per-row losses
    t_rows = torch.tensor(t0, requires_grad=True)
    (chunked.chunked_row_losses(h, cand, kw.get("labels"), t_rows, chunk_size) * weights).sum().backward()
    t_plain = torch.tensor(t0, requires_grad=True)
    s = h @ cand.T / t_plain
    plain = torch.logsumexp(s, 1) - (s.gather(1, kw["labels"][:, None])[:, 0] if "labels" in kw else 0)
    (plain * weights).sum().backward()
    assert t_rows.grad.item() == pytest.approx(t_plain.grad.item(), rel=1e-9, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), m=st.integers(2, 7), chunk_size=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_ignored_rows_are_left_out_as_the_plain_loss_leaves_them(n, m, chunk_size, seed):
    """Rows labelled -100 (F.cross_entropy's ignore_index): the chunked mean, its gradients and the per-row losses
    are the plain ones', ignored rows scoring 0 with no gradient; all rows ignored: NaN, as plain."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, 3, generator=g), torch.randn(m, 3, generator=g)
    labels = torch.randint(0, m, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.4] = chunked.IGNORE_INDEX
    want, want_grads = loss_and_grads(lambda h, w: F.cross_entropy(h @ w.T, labels), h, w)
    got, got_grads = loss_and_grads(lambda h, w: chunked.chunked_cross_entropy(h, w, labels, 1.0, chunk_size), h, w)
    if (labels == chunked.IGNORE_INDEX).all():
        assert math.isnan(want.item()) and math.isnan(got.item())
        return
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    rows = chunked.chunked_row_losses(h, w, labels, 1.0, chunk_size)
    torch.testing.assert_close(rows, F.cross_entropy(h @ w.T, labels, reduction="none"), rtol=1e-12, atol=1e-12)

"""torch.compile on CPU: every objective traces as one graph (fullgraph: a graph break raises), compiles
once (no recompile over batches of other content), and gives the eager values and gradients.

The backend is aot_eager: Dynamo's tracing, graph breaks and recompiles are those of any backend, and AOT
autograd traces the backward too; it runs the traced aten ops eagerly, so the figures agree with eager
ones to fp32 rounding (TOL). Inductor's kernels are exercised by `train.py --compile` and bench.py.
"""
import dataclasses
import functools
import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import data
import train
from loss import LossConfig
from masking import NOT_MASKED, Masking, MaskSpec, mask_tokens, masked_count, masked_rows
from model import GPT, GPTConfig
from train import Objective, TrainConfig

BACKEND = "aot_eager"
TOL = dict(rtol=1e-5, atol=1e-6)  # aot_eager against eager, fp32
SPEC = MaskSpec(mask_token=60, vocab_size=60, special_tokens=(59,))
B, T = 4, 16

# A pairwise cover: each objective with each loss, each negatives option (all, unique, k sampled, unique
# and k) and chunking; each loss with chunking and with other negatives.
CASES = [
    dict(objective="causal", loss="ce"),
    dict(objective="causal", loss="cwt", negatives="unique", loss_chunk_size=40),
    dict(objective="causal", loss="ce+cwt", num_negatives=8, loss_chunk_size=40),
    dict(objective="causal", loss="nce", negatives="unique", num_negatives=8),
    dict(objective="mlm", loss="ce", loss_chunk_size=5),
    dict(objective="mlm", loss="cwt", loss_chunk_size=5),
    dict(objective="mlm", loss="ce+cwt", negatives="unique", num_negatives=4, loss_chunk_size=5),
    dict(objective="mlm", loss="nce", num_negatives=4),
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def batches(objective: str, n: int = 3):
    """n micro-batches (inputs, targets, sampled negatives drawn ahead) of other content each: other
    tokens, so another number of distinct ones; for an encoder, special tokens in other places, so the
    masked positions move."""
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        x = torch.randint(0, 59, (B, T + 1), generator=g)
        x[:, torch.randint(0, T, (2 * i,), generator=g)] = 59
        inputs, targets = mask_tokens(x[:, :T], 0, i, SPEC) if objective == "mlm" else (x[:, :T], x[:, 1:])
        yield inputs, targets, torch.randperm(targets.numel(), generator=torch.Generator().manual_seed(i))


def tiny_model(cfg: TrainConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=1, n_head=2, d_model=16,
                          causal=cfg.objective == "causal"))
    if cfg.loss == "nce":
        model.add_lm_head()
    return model


def loss_and_grads(objective, model, *args):
    loss = objective(*args)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_objective_compiles_whole_once_and_gives_eager_values(case):
    cfg = TrainConfig(**case)
    model = tiny_model(cfg)
    eager = Objective(model, cfg, Masking(spec=SPEC) if cfg.objective == "mlm" else None)
    compiled = torch.compile(eager, backend=BACKEND, fullgraph=True)
    for step, (x, y, order) in enumerate(batches(cfg.objective)):
        want, want_grads = loss_and_grads(eager, model, x, y, order)
        got, got_grads = loss_and_grads(compiled, model, x, y, order)
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, **TOL)
        assert graphs() == 1, f"step {step}: {graphs()} graphs"  # one, and no recompile after the first step


def test_masked_rows_static_shape_equals_boolean_indexing():
    h = torch.randn(B, T, 8)
    for _, y, _ in batches("mlm"):
        rows = B * masked_count(T)
        assert (y != NOT_MASKED).sum() == rows  # a fixed count, whatever the special tokens
        keep = y != NOT_MASKED
        for a, b in zip(masked_rows(h, y), (h[keep], y[keep])):  # the same rows, in the same order
            assert torch.equal(a, b)


def test_encoder_validation_compiled_gives_eager_figures(monkeypatch):
    """evaluate with Validation(compile=True) for an encoder: masked rows gathered in the graph, full batches through
    one compiled graph, the short last batch eager, the figures eager's."""
    import numpy as np

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=BACKEND))
    cfg = TrainConfig(objective="mlm")
    model = tiny_model(cfg)
    tokens = np.random.default_rng(0).integers(0, 59, 5 * T + 1).astype(np.uint16)  # batches of 2, 2 and 1
    objective, split = Objective(model, LossConfig(loss="cwt"), Masking(seed=0, spec=SPEC)), train.ValSplit(tokens)
    want = train.evaluate(objective, split, train.Validation(batch_size=2, block_size=T))
    got = train.evaluate(objective, split, train.Validation(batch_size=2, block_size=T, compile=True))
    assert got == pytest.approx(want, rel=1e-5) and graphs() == 1


@pytest.mark.usefixtures("small_tiny_preset")
def test_train_compile_validates_in_its_own_graph_and_matches_eager(tiny_data_dir, tmp_path, monkeypatch):
    """train.py --compile: the objective and validation compile once each (the step-0 validation, the
    train/eval switches, a short last validation batch and the steps after recompile nothing), and the
    losses and validation figures are eager's."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=BACKEND))
    val_tokens = 32 * 8 + 32 * 3 + 1  # a full validation batch of 8 x 32 tokens, and a short one of 3
    monkeypatch.setattr(train, "open_val_split", functools.partial(short_val_split, val_tokens))
    runs = {}
    for compile in (False, True):
        out = tmp_path / str(compile)
        train.train(TrainConfig(dataset=str(tiny_data_dir), preset="tiny", block_size=32, batch_size=8,
                                max_iters=2, eval_interval=1, eval_batches=2, log_interval=1, out_dir=str(out),
                                device="cpu", seed=0, num_negatives=50, compile=compile))
        runs[compile] = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert graphs() == 2  # training and validation, one graph each
    figures = {"loss", "val_ce", "val_cwt", "val_acc", "val_bpb"}  # a progress record's loss, a validation's rest
    for eager, compiled in zip(runs[False], runs[True], strict=True):
        assert compiled.keys() == eager.keys()
        assert (compiled["step"], compiled["tokens"]) == (eager["step"], eager["tokens"])
        for key in sorted(figures & eager.keys()):
            assert compiled[key] == pytest.approx(eager[key], rel=1e-5), key
    assert {key for record in runs[False] for key in record} >= figures  # every figure was compared


def short_val_split(tokens: int, *args, **kwargs) -> data.ValSplit:
    """data.open_val_split, cut to its first `tokens` tokens (and their byte counts)."""
    split = data.open_val_split(*args, **kwargs)
    return dataclasses.replace(split, tokens=split.tokens[:tokens], byte_counts=split.byte_counts[:tokens])

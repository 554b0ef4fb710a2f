"""Data parallelism on CPU (gloo, two processes): the same results however the batch is split over ranks,
negatives gathered across ranks, checkpoints that move between world sizes, and a clean stop on SIGTERM."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import read_ckpt

import cli
import common
import ddp
import model
import train
from loss import cwt_loss
from train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
HAVE_NEGATIVES = (ROOT / "negatives.py").is_file()  # an extra: a fork may delete it (and its test file)
needs_negatives = pytest.mark.skipif(not HAVE_NEGATIVES, reason="negatives.py is not in this checkout")
SMALL_TINY = dict(n_layer=2, n_head=2, d_model=64, block_size=64)  # as conftest's small_tiny_preset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """Ten steps whose learning rate depends on the step alone (constant after warmup), so a run can stop
    early and be continued with another max_iters."""
    settings = dict(dataset=str(data_dir), preset="tiny", block_size=16, batch_size=2, max_iters=10,
                    warmup_iters=3, lr=3e-3, lr_schedule="constant", eval_interval=10, eval_batches=3,
                    log_interval=1, out_dir=str(out_dir), device="cpu", seed=0)
    return TrainConfig(**{**settings, **overrides})



def weights(out_dir) -> dict[str, torch.Tensor]:
    return read_ckpt(Path(out_dir) / "ckpt.safetensors")["model"]


def max_weight_difference(a, b) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def read_log(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# Two ranks started with torch.multiprocessing (one start-up for all the checks that need no torchrun)


def negatives_inputs(n_per_rank: int = 12, d: int = 8, vocab: int = 9):
    """h (2n, d), the embeddings e of the targets (2n, d) and the targets, with repeats within and across
    ranks, as two ranks' halves would see them."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, d, generator=gen)
    targets = torch.randint(0, vocab, (2 * n_per_rank,), generator=gen)
    return torch.randn(2 * n_per_rank, d, generator=gen), table[targets], targets


def _global_negatives_on_rank(out: Path) -> None:
    from negatives import contrastive_loss

    rank, n = ddp.rank(), 12
    h_all, e_all, t_all = negatives_inputs(n)
    rows = slice(rank * n, (rank + 1) * n)
    result = {}
    for negatives in ("all", "unique"):
        h, e = h_all[rows].clone().requires_grad_(), e_all[rows].clone().requires_grad_()
        loss = contrastive_loss(h, e, 0.5, targets=t_all[rows], negatives=negatives, scope="global")
        loss.backward()
        result[negatives] = (loss.detach(), h.grad, e.grad)
    torch.save(result, out / f"negatives{rank}.pt")


class RankStateObjective(train.Objective):
    """A fork's objective with a buffer that holds each rank's own state (a queue of its own past targets would):
    0 at the start, then rank r adds r + 1 at each forward. What each forward saw is kept, to check DDP never
    overwrote it with rank 0's."""
    made: list[RankStateObjective] = []

    def __init__(self, model, config, mask=None):
        super().__init__(model, config, mask)
        self.register_buffer("own", torch.zeros(1))
        self.seen: list[float] = []
        RankStateObjective.made.append(self)

    def forward(self, x, y, generator=None):
        self.seen.append(self.own.item())
        self.own += ddp.rank() + 1
        return super().forward(x, y, generator)


def _rank_main(rank: int, port: int, out: str, jobs: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    model.PRESETS["tiny"] = SMALL_TINY
    ddp.init_distributed(torch.device("cpu"))
    if HAVE_NEGATIVES:
        _global_negatives_on_rank(Path(out))
    real_all_reduce, calls = torch.distributed.all_reduce, []
    torch.distributed.all_reduce = lambda *a, **k: calls.append(1) or real_all_reduce(*a, **k)
    for job in jobs:
        calls.clear()
        if job["out_dir"].endswith("two-own-buffer"):
            real_objective, train.Objective = train.Objective, RankStateObjective
        cfg = TrainConfig(**job)
        if job["out_dir"].endswith("two-disagree"):  # a rank launched by hand with another --max_iters
            try:
                train.train(dataclasses.replace(cfg, max_iters=cfg.max_iters + rank))
            except common.UserError as e:
                (Path(out) / f"disagree{rank}.txt").write_text(str(e))  # beside: the run's folder is removed
            continue
        train.train(cfg, cli.given_settings(cfg) | {"grad_accum"})  # grad_accum=1 too, its default
        if job["out_dir"].endswith("two-own-buffer"):
            train.Objective = real_objective
            seen = [v for o in RankStateObjective.made for v in o.seen]
            (Path(job["out_dir"]) / f"seen{ddp.rank()}.json").write_text(json.dumps(seen))
        (Path(job["out_dir"]) / f"all_reduces{ddp.rank()}.txt").write_text(str(len(calls)))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(tiny_data_dir, tmp_path_factory):
    """Single-process references (grad_accum=2) and the same runs on 2 ranks (grad_accum=1)."""
    root = tmp_path_factory.mktemp("ddp")
    with pytest.MonkeyPatch.context() as mp_patch:
        mp_patch.setitem(model.PRESETS, "tiny", SMALL_TINY)
        for loss in ("ce", "cwt"):
            train.train(run_config(tiny_data_dir, root / f"one-{loss}", loss=loss, grad_accum=2, dropout=0.1))
        # a single-process checkpoint at step 5, continued below on two ranks
        train.train(run_config(tiny_data_dir, root / "two-cwt-resumed", grad_accum=2, dropout=0.1,
                               max_iters=5))
    jobs = [vars(run_config(tiny_data_dir, root / f"two-{loss}", loss=loss, dropout=0.1))
            for loss in ("ce", "cwt")]
    jobs.append(vars(run_config(tiny_data_dir, root / "two-cwt-resumed", dropout=0.1, resume=True)))
    if HAVE_NEGATIVES:
        jobs.append(vars(run_config(tiny_data_dir, root / "two-global", max_iters=3, negatives_scope="global",
                                    negatives="unique")))
    jobs.append(vars(run_config(tiny_data_dir, root / "two-quiet", log_interval=5)))
    jobs.append(vars(run_config(tiny_data_dir, root / "two-own-buffer", max_iters=3)))
    jobs.append(vars(run_config(tiny_data_dir, root / "two-disagree", max_iters=3)))
    mp.start_processes(_rank_main, args=(free_port(), str(root), jobs), nprocs=2, start_method="spawn")
    return root


@pytest.mark.parametrize("loss", ["ce", "cwt"])
def test_two_ranks_equal_one_process_with_twice_the_accumulation(two_rank_runs, loss):
    one, two = two_rank_runs / f"one-{loss}", two_rank_runs / f"two-{loss}"
    assert read_ckpt(two / "ckpt.safetensors")["state"]["step"] == 10
    assert max_weight_difference(one, two) < 1e-5
    losses = lambda d: [r["loss"] for r in read_log(d) if "loss" in r]  # noqa: E731
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)  # rank 0 logs the mean over ranks
    # sharded validation (3 batches: rank 0 scores two, rank 1 one) equals one process's
    first_val = lambda d: next({k: v for k, v in r.items() if k != "run_id"} for r in read_log(d) if "val_ce" in r)  # noqa: E731
    assert first_val(two) == pytest.approx(first_val(one), rel=1e-12)


def test_single_process_checkpoint_continues_on_two_ranks(two_rank_runs):
    resumed = two_rank_runs / "two-cwt-resumed"
    assert read_ckpt(resumed / "ckpt.safetensors")["state"]["step"] == 10
    assert max_weight_difference(two_rank_runs / "one-cwt", resumed) < 1e-5


@needs_negatives
def test_global_negatives_equal_one_process_over_both_micro_batches(two_rank_runs):
    from negatives import contrastive_loss

    h_all, e_all, t_all = negatives_inputs()
    for negatives in ("all", "unique"):
        h, e = h_all.clone().requires_grad_(), e_all.clone().requires_grad_()
        expected = contrastive_loss(h, e, 0.5, targets=t_all, negatives=negatives)
        expected.backward()
        ranks = [torch.load(two_rank_runs / f"negatives{r}.pt")[negatives] for r in (0, 1)]
        # each rank's loss is the mean over its own rows; DDP then averages the gradients over ranks
        assert (ranks[0][0] + ranks[1][0]) / 2 == pytest.approx(expected.item(), rel=1e-6)
        torch.testing.assert_close(torch.cat([r[1] for r in ranks]) / 2, h.grad)
        torch.testing.assert_close(torch.cat([r[2] for r in ranks]) / 2, e.grad)
    # the gathered candidates are not the local ones: a rank alone gets another loss
    local = cwt_loss(h_all[:12], e_all[:12], 0.5)
    assert abs(local.item() - torch.load(two_rank_runs / "negatives0.pt")["all"][0].item()) > 1e-3


def test_one_all_reduce_per_log_interval_and_none_between(two_rank_runs):
    # 10 steps, logged every 5th, validated at steps 0 and 10: the loss and the stop flag travel together
    # in one all-reduce per log step (it was two on every step), plus one per validation and one at start-up
    # (do all ranks see the same checkpoint?)
    for rank in (0, 1):
        assert (two_rank_runs / "two-quiet" / f"all_reduces{rank}.txt").read_text() == "5"
    assert [r["step"] for r in read_log(two_rank_runs / "two-quiet") if "loss" in r] == [5, 10]


def test_a_buffer_of_the_objective_keeps_each_ranks_own_state(two_rank_runs):
    """Issue 39: DDP syncs no buffer at a forward (ddp.wrapped), so a fork's per-rank state survives every
    step; rank 0's is the one saved."""
    out = two_rank_runs / "two-own-buffer"
    seen = [json.loads((out / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [[0.0, 1.0, 2.0], [0.0, 2.0, 4.0]]  # 3 steps, one micro-batch each
    assert read_ckpt(out / "ckpt.safetensors")["objective"]["own"].item() == 3.0


@needs_negatives
def test_global_negatives_train(two_rank_runs):
    log = read_log(two_rank_runs / "two-global")
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)


def test_ranks_started_with_other_settings_both_stop_in_one_line(two_rank_runs):
    """Issue 42, contract 8: every rank compares a digest of its settings at the start and refuses on a
    difference, on every rank, before a step (ranks with another --max_iters used to hang at the end)."""
    said = [(two_rank_runs / f"disagree{rank}.txt").read_text() for rank in (0, 1)]
    assert all(s.startswith("the ranks were started with different settings") for s in said), said
    assert not (two_rank_runs / "two-disagree" / "ckpt.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# torchrun itself: SIGTERM, one checkpoint, and a resume in one process


def wait_for_step(log: Path, step: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if log.is_file() and any(json.loads(line).get("step", 0) >= step and "loss" in json.loads(line)
                                 for line in log.read_text().splitlines() if line.endswith("}")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {log} after {timeout} s")


def test_sigterm_to_torchrun_stops_both_ranks_then_one_process_resumes(tiny_data_dir, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "worker-logs"
    cfg = run_config(tiny_data_dir, out, max_iters=10_000, eval_interval=10_000, eval_batches=1)
    flags = [f"--{k}={v}" for k, v in vars(cfg).items() if k in ("dataset", "preset", "block_size",
             "batch_size", "max_iters", "warmup_iters", "lr", "lr_schedule", "eval_interval", "eval_batches",
             "log_interval", "out_dir", "device", "seed")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", f"--log-dir={logs}", "--redirects=3",
                             str(ROOT / "train.py"), *flags, "--resume=auto"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out / "log.jsonl", 2, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)  # no hang: both ranks agree on the stop step
    finally:
        proc.kill()
    ckpt = read_ckpt(out / "ckpt.safetensors")
    stopped = ckpt["state"]["step"]
    assert 2 <= stopped < 10_000 and not list(out.glob("*.tmp"))  # one checkpoint, nothing half-written
    stderr = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == ["0", "1"]
    assert f"stopped at step {stopped}; checkpoint saved" in stderr["0"] and "Traceback" not in stderr["0"]
    assert stderr["1"].strip() == ""  # rank 1 prints nothing, and stopped cleanly
    logged = [r["step"] for r in read_log(out) if "loss" in r]
    assert logged[-1] == stopped

    # One process, twice the accumulation, --resume=auto: continues the 2-rank run exactly ...
    more = stopped + 3
    summary = train.train(run_config(tiny_data_dir, out, max_iters=more, eval_interval=10_000, eval_batches=1,
                                     grad_accum=2, resume="auto"))
    assert summary["step"] == more
    assert [r["step"] for r in read_log(out) if "loss" in r] == list(range(1, more + 1))
    # ... where a fresh one (--resume=auto, no checkpoint yet) takes the same steps in one go
    straight = tmp_path / "straight"
    train.train(run_config(tiny_data_dir, straight, max_iters=more, eval_interval=10_000, eval_batches=1,
                           grad_accum=2, resume="auto"))
    assert [r["step"] for r in read_log(straight) if "loss" in r] == list(range(1, more + 1))
    assert max_weight_difference(out, straight) < 1e-5


@pytest.mark.parametrize("flag, value", [("--resume", True), ("--resume=true", True),
                                         ("--resume=false", False), ("--resume=auto", "auto")])
def test_resume_flag_values(flag, value):
    assert cli.parse_flags(TrainConfig, [flag]).resume == value


def test_resume_flag_rejects_other_values():
    with pytest.raises(common.UserError, match="choose one of: true, false, auto"):
        cli.parse_flags(TrainConfig, ["--resume=maybe"])


def test_without_torchrun_there_is_no_process_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert ddp.init_distributed(torch.device("cpu")) == torch.device("cpu")
    assert not torch.distributed.is_initialized() and ddp.world_size() == 1 and ddp.is_main_process()
    assert ddp.all_reduce_sum(torch.ones(2)).tolist() == [1.0, 1.0]


PEER_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import common, ddp, torch
def main(argv):
    ddp.init_distributed(torch.device("cpu"))
    if ddp.rank() == 1:
        raise common.UserError("a setting this rank refuses")
    ddp.all_reduce_sum(torch.ones(1))  # rank 0 waits for a rank that is gone
common.run_main(main)
"""


def test_a_rank_that_fails_ends_the_job_in_one_line_on_every_rank(tmp_path):
    """Issue 42, contract 8: rank 1 stops on its own error; rank 0, in a collective with it, says in one line that
    another rank stopped (it printed gloo's traceback), and both exit 2."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, str(ROOT)], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "OMP_NUM_THREADS": "1"}) for rank in (0, 1)]
    said = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2]
    assert said[1].strip() == "error (rank 1): a setting this rank refuses"
    assert said[0].count("\n") == 1 and said[0].startswith("error (rank 0): another rank of this job stopped"), said[0]

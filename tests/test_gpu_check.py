"""bench.py --gpu_check and --mode=ddp: what runs without a GPU. Without CUDA, --gpu_check is a CPU dry run of
the same checks; here with torch.compile's eager backend (inductor builds for minutes on a CPU) and smaller
shapes, so the whole dry run, train.py --compile included, takes seconds (in one thread: on a busy 2-core machine
the small ops are slower in two). Flash attention runs on the CPU's own flash kernel below; NCCL only on GPUs."""
from __future__ import annotations

import math
import re

import pytest
import torch

import bench
from common import UserError

SMALL = bench.CheckShape(preset="tiny", vocab=512, block=32, batch=2, steps=6, repeats=2, train_iters=3)
CPU = torch.device("cpu")


def table_rows(report: str, first_cell: str) -> list[list[str]]:
    """The cells of every markdown row of `report` whose first cell is `first_cell` (a cell's \\| is its |)."""
    lines = [line.strip().strip("|") for line in report.splitlines() if line.startswith("|")]
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)] for line in lines]
    return [row for row in rows if row[0] == first_cell]


def test_without_cuda_gpu_check_is_a_cpu_dry_run_with_the_same_report(monkeypatch, capsys, one_thread):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # train.py's run too
    monkeypatch.setattr(bench, "DRY_RUN_SHAPE", SMALL)
    monkeypatch.setattr(bench, "DRY_RUN_STEP_SHAPE", bench.CheckShape(vocab=1024, block=32, batch=2, repeats=2))
    with pytest.raises(SystemExit) as done:
        bench.main(["--gpu_check", "--check_backend=eager", "--check_presets=tiny"])
    assert done.value.code == 0
    report = capsys.readouterr().out
    assert report.startswith("CPU dry run of the GPU check (not a GPU result):")
    assert "torch.compile backend eager" in report.splitlines()[0]
    results = {}
    for name in ("bf16 autocast + fused AdamW", "fp16 autocast + GradScaler", "fused AdamW = for-each",
                 "flash attention (SDPA)", "torch.compile (eager), CE and CWT", "KV-cache generation",
                 "train.py --compile (eager)", "DDP over NCCL"):
        (row,) = table_rows(report, name)
        results[name] = (row[1], row[2])
    assert results["flash attention (SDPA)"][0] == results["DDP over NCCL"][0] == "skipped"
    assert results["flash attention (SDPA)"][1].startswith("CUDA only")
    assert all(result == "ok" for name, (result, _) in results.items() if "flash" not in name and "DDP" not in name)
    assert "MFU n/a" in results["bf16 autocast + fused AdamW"][1]
    assert "loss scale" in results["fp16 autocast + GradScaler"][1]
    assert "0 graph breaks, 0 recompiles" in results["torch.compile (eager), CE and CWT"][1]
    assert re.search(r"step 3/3 \| loss [\d.]+ \|.* tok/s", results["train.py --compile (eager)"][1])
    steps = table_rows(report, "tiny")
    assert [row[1:3] for row in steps] == [["ce", "2x32"], ["cwt", "2x32"]]
    for row in steps:
        eager_ms, compiled_ms, ratio, tok_s = (float(c.replace(",", "")) for c in row[3:7])
        assert eager_ms > 0 and compiled_ms > 0 and ratio > 0 and tok_s > 0
        assert row[7:9] == ["n/a", "n/a"]  # MFU and peak memory: not on a CPU
        assert math.isfinite(float(row[9])) and row[10:] == ["0", "0"]  # compile s; graph breaks, recompiles
    assert "V=1024, float32; median of 2" in report
    assert report.rstrip().endswith("6 of 6 checks passed, 2 skipped")


def test_graph_breaks_are_counted(monkeypatch):
    class Breaking(torch.nn.Module):  # an objective with one graph break, cheap to trace
        def __init__(self, model, cfg):
            super().__init__()
            self.model = model

        def forward(self, x, y, generator):
            h = self.model.wte(x)
            torch._dynamo.graph_break()
            return h.square().mean()
    monkeypatch.setattr(bench, "Objective", Breaking)
    row = bench.measure_step(CPU, SMALL, torch.float32, "cwt", "eager")
    assert row.graph_breaks == 1 and row.recompiles == 0
    assert row.loss_compiled == pytest.approx(row.loss_eager, rel=1e-6)


def test_check_settings_are_refused_before_any_work():
    with pytest.raises(UserError, match="check_presets"):
        bench.main(["--gpu_check", "--check_presets=tiny,nano"])
    with pytest.raises(UserError, match="check_backend"):
        bench.main(["--gpu_check", "--check_backend=cudagraph"])


def test_flash_attention_check_runs_on_the_cpu_flash_kernel():
    assert bench.check_flash_attention(CPU, SMALL, torch.bfloat16).startswith("flash kernel")


def test_failing_and_skipped_checks_are_reported_and_the_others_still_run():
    def broken():
        raise ValueError("no kernel\nsecond line")
    rows = bench.run_checks({"broken": broken, "gpu": bench.skip("CUDA only: tensor cores"),
                             "fine": lambda: "all good"})
    report = bench.checks_report(rows, "GPU check: test")
    assert "| broken | FAILED | ValueError: no kernel |" in report and "| fine | ok | all good |" in report
    assert "| gpu | skipped | CUDA only: tensor cores |" in report
    assert report.endswith("1 of 2 checks passed, 1 skipped")


def test_ddp_bench_in_one_process_reports_per_rank_figures():
    cfg = bench.BenchConfig(mode="ddp", preset="tiny", vocab=[512], step_tokens=[64], block_size=32,
                            step_variants=["cwt"], warmup=1, repeats=2, device="cpu")
    table = bench.bench_ddp(cfg)
    row = next(line for line in table.splitlines() if line.startswith("| cwt |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1" and float(cells[2].replace(",", "")) > 0 and float(cells[5]) > 0

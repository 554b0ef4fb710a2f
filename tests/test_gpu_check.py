"""bench.py --gpu_check and --mode=ddp: what runs without a GPU. The checks themselves take a device, so
those that also work on a CPU (bf16 and fp16 autocast, fused AdamW, flash attention, the KV cache) are run
here on a small shape; torch.compile (slow to build on CPU) and NCCL only run on a GPU machine."""
from __future__ import annotations

import pytest
import torch

import bench
from common import UserError

SMALL = bench.CheckShape(preset="tiny", vocab=512, block=32, batch=2, steps=6)
CPU = torch.device("cpu")


def test_gpu_check_without_cuda_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--gpu_check needs a CUDA GPU"):
        bench.main(["--gpu_check"])


@pytest.mark.parametrize("dtype, loss", [(torch.bfloat16, "cwt"), (torch.float16, "ce")])
def test_training_check_learns_a_fixed_batch(dtype, loss):
    detail = bench.check_training(CPU, SMALL, dtype, loss)
    first, last = (float(v) for v in detail.split(" loss ")[1].split(",")[0].split(" -> "))
    assert last < first and "tok/s" in detail
    assert ("loss scale" in detail) == (dtype == torch.float16)


def test_cpu_runnable_checks_pass():
    rows = bench.run_checks({"adamw": lambda: bench.check_fused_adamw(CPU, SMALL),
                             "flash": lambda: bench.check_flash_attention(CPU, SMALL, torch.bfloat16),
                             "kv": lambda: bench.check_kv_cache(CPU, SMALL, new_tokens=8)})
    assert [(name, passed) for name, passed, _, _ in rows] == [("adamw", True), ("flash", True), ("kv", True)]


def test_a_failing_check_is_reported_and_the_others_still_run():
    def broken():
        raise ValueError("no kernel\nsecond line")
    rows = bench.run_checks({"broken": broken, "fine": lambda: "all good"})
    report = bench.checks_report(rows, "GPU check: test")
    assert "| broken | FAILED | ValueError: no kernel |" in report and "| fine | ok | all good |" in report
    assert report.endswith("1 of 2 checks passed")


def test_ddp_bench_in_one_process_reports_per_rank_figures():
    cfg = bench.BenchConfig(mode="ddp", preset="tiny", vocab=[512], step_tokens=[64], block_size=32,
                            step_variants=["cwt"], warmup=1, repeats=2, device="cpu")
    table = bench.bench_ddp(cfg)
    row = next(line for line in table.splitlines() if line.startswith("| cwt |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "1" and float(cells[2].replace(",", "")) > 0 and float(cells[5]) > 0

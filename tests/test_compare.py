"""compare.py: the equal-compute budget and the whole CE vs CWT (+ fine-tune) experiment."""
from __future__ import annotations

import pytest

import compare
from conftest import refused_before_any_work

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def test_flop_budget_solver_gives_equal_budgets():
    # CE 100 steps at 44 FLOPs/token; CWT at 6 plus 2% of its steps fine-tuned at CE's 44:
    # 6n + 44 ceil(n/50) <= 4400
    n, ft = compare.solve_cwt_iters(100, 44.0, 6.0, 0.02)
    assert (n, ft) == (638, 13)
    assert 6 * 638 + 44 * 13 == 100 * 44  # exactly the budget here
    assert 6 * 639 + 44 * 13 > 100 * 44  # one more step would exceed it


def test_compare_end_to_end(tiny_data_dir, tmp_path):
    cfg = compare.CompareConfig(dataset=str(tiny_data_dir), quick=True, out_dir=str(tmp_path / "cmp"),
                                device="cpu")
    result = compare.run_compare(cfg)
    runs, budget = result["runs"], result["budget_flops"]
    assert runs["ce"]["flops"] == pytest.approx(budget)
    assert runs["cwt"]["flops"] < runs["cwt-ft"]["flops"] <= budget * (1 + 1e-9)
    one_more = result["tokens_per_iter"] * (result["flops_per_token"]["cwt"]
                                            + result["flops_per_token"]["ce"])
    assert runs["cwt-ft"]["flops"] > budget - one_more  # CWT gets all the budget it can use
    assert all(run["val_ce"] > 0 for run in runs.values())
    for name, curve in result["curves"].items():
        assert curve and all(x2 >= x1 for (x1, _), (x2, _) in zip(curve, curve[1:]))
    assert result["curves"]["cwt-ft"][0][0] == pytest.approx(runs["cwt"]["flops"])
    assert "skipped" in runs["ce"]["lambada"]["note"]


def test_bad_numbers_are_refused_before_any_work(tmp_path):
    refused_before_any_work(compare.main, ["--out_dir=OUT/out", "--ce_iters=0"], "--ce_iters must be at least 1, got 0",
                            tmp_path)

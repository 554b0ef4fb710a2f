"""results.py: what the measuring scripts write."""
import math

import results


def test_a_capped_perplexity_prints_short():
    assert results.format_metric(math.exp(700)) == "1.014e+304"
    assert results.format_metric(12.345678) == "12.3457"


def test_a_non_finite_result_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    import pytest

    from common import UserError

    with pytest.raises(UserError, match=r"the results: rows\[1\]: ppl is nan, not a finite number") as e:
        results.write_json(tmp_path / "r.json", {"rows": [{"ppl": 3.0}, {"ppl": math.nan}]})
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
    results.write_json(tmp_path / "r.json", {"rows": [{"ppl": 3.0, "note": None}]})
    assert (tmp_path / "r.json").is_file()

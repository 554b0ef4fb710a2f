"""results.py: what the measuring scripts write."""
import math

import results


def test_a_capped_perplexity_prints_short():
    assert results.format_metric(math.exp(700)) == "1.014e+304"
    assert results.format_metric(12.345678) == "12.3457"

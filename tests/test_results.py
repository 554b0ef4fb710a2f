"""results.py: what the measuring scripts write."""
import math

import common
import results


def test_a_capped_perplexity_prints_short():
    assert common.format_metric(math.exp(700)) == "1.014e+304"
    assert common.format_metric(12.345678) == "12.3457"


def test_a_non_finite_result_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    import pytest

    from common import UserError

    with pytest.raises(UserError, match=r"the results: rows\[1\]: ppl is nan, not a finite number") as e:
        results.write_json(tmp_path / "r.json", {"rows": [{"ppl": 3.0}, {"ppl": math.nan}]})
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
    results.write_json(tmp_path / "r.json", {"rows": [{"ppl": 3.0, "note": None}]})
    assert (tmp_path / "r.json").is_file()


def test_results_plot_draws_each_metric_against_tokens_a_line_a_run(tiny_data_dir, tmp_path, monkeypatch,
                                                                    small_tiny_preset):
    """python results.py --log=A,B --plot=FILE: a panel a metric (training loss, then each validation metric), a
    line a run (a metric a run lacks: no line), every point log.jsonl's (x: tokens); a real PNG."""
    import pytest

    pytest.importorskip("matplotlib")
    from helpers import read_log, tiny_config

    import train

    for loss in ("cwt", "ce"):
        train.train(tiny_config(tiny_data_dir, tmp_path / f"out-{loss}", loss=loss, block_size=16, batch_size=2,
                                max_iters=4, warmup_iters=1, eval_interval=2, eval_batches=1))
    figures = []
    monkeypatch.setattr(results, "save_figure", lambda fig, path: figures.append(fig) or fig.savefig(path))
    logs = [tmp_path / "out-cwt" / "log.jsonl", tmp_path / "out-ce" / "log.jsonl"]
    results.main([f"--log={logs[0]},{logs[1]}", f"--plot={tmp_path / 'curves.png'}"])
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    panels = {ax.get_title(): ax for ax in figures[0].axes if ax.get_visible()}
    assert list(panels) == [results.CURVE_TITLES[m] for m in ("loss", "val_ce", "val_bpb", "val_ppl", "val_cwt",
                                                              "val_acc")]
    for metric in ("loss", "val_ce", "val_acc"):
        lines = {line.get_label(): line for line in panels[results.CURVE_TITLES[metric]].get_lines()}
        assert sorted(lines) == (["out-ce", "out-cwt"] if metric != "val_acc" else ["out-cwt"])  # CE has no CWT
        for label, log in zip(("out-cwt", "out-ce"), logs):
            if label in lines:
                records = [r for r in read_log(log.parent) if metric in r]
                x, y = lines[label].get_data()
                assert list(x) == [r["tokens"] for r in records]
                assert list(y) == pytest.approx([r[metric] for r in records])


def test_results_plot_refuses_in_one_line_before_drawing(tmp_path, monkeypatch):
    """No matplotlib, a log line that is not a record, a missing flag: one line, nothing written; a last line a
    crash cut short is left out, as --resume does."""
    import importlib.util
    import sys

    import pytest

    import doors
    from common import UserError

    log = tmp_path / "out" / "log.jsonl"
    log.parent.mkdir()
    log.write_text('{"step": 0, "tokens": 0, "val_ce": 10.8}\n{"step": 10, "tokens": 2560, "loss": 7.6}\n{"step": 2')
    assert [r["step"] for r in doors.run_log(log, cut_ok=True)] == [0, 10]
    log.write_text('{"step": 0, "tokens": 0, "val_ce": 10.8}\n[1, 2]\n{"step": 10, "tokens": 2560, "loss": 7.6}\n')
    with pytest.raises(doors.Refused, match=r"log.jsonl line 2: is \[1, 2\], not a table; move the damaged log"):
        doors.run_log(log, cut_ok=True)
    log.write_text('{"step": 0, "val_ce": 10.8}\n')
    with pytest.raises(doors.Refused, match="line 1: lacks tokens"):
        doors.run_log(log, cut_ok=True)
    with pytest.raises(UserError, match="pass --log=out/log.jsonl"):
        results.main([f"--log={log}"])
    if importlib.util.find_spec("matplotlib"):  # issue 42: a format matplotlib cannot write, before any work
        with pytest.raises(UserError, match=r"--plot=.*c.xyz: matplotlib writes no .xyz file; name it .png"):
            results.main([f"--log={log}", f"--plot={tmp_path / 'c.xyz'}"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match="pip install matplotlib"):
        results.main([f"--log={log}", f"--plot={tmp_path / 'c.png'}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

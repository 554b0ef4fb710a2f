"""Every figure a docs page quotes from a run is read back from that run's results file (results/*.json): the prose
and the file cannot disagree. Each figure is tied to its JSON value by a fragment of the page's text in which it
stands (`{}` where a figure is, the JSON values in order), compared at the precision the page shows it; a table
row by its label. docs/analysis.md's Results section is held whole: a number there that no fragment ties to the
file (or that NOT_FROM_RESULTS does not name, with the reason it comes from elsewhere) fails, so a new figure must
be tied as it is written."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import plan
import train

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d[\d,]*(?:\.\d+)?"
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def results(name: str):
    return json.loads((ROOT / "results" / name).read_text())


def flat(text: str) -> str:
    """One space for any whitespace: a fragment may span lines."""
    return re.sub(r"\s+", " ", text)


def shown_equals(shown: str, value: float) -> bool:
    """Whether `value` rounds to the figure as shown (its decimals); a comma groups thousands."""
    digits = shown.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return abs(float(digits) - value) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def fragment_regex(fragment: str) -> str:
    return f"({NUMBER})".join(re.escape(part) for part in flat(fragment).split("{}"))


def find_figures(text: str, fragment: str, values: list) -> tuple[int, int]:
    """The span of `fragment` in `text` with each {} a figure equal to its value (a tuple: every one of them);
    fails, naming the fragment, when the page no longer says it or a figure disagrees with the file."""
    found = re.search(fragment_regex(fragment), text)
    assert found, f"the page no longer says: {fragment!r}"
    assert len(found.groups()) == len(values), fragment
    for shown, value in zip(found.groups(), values):
        for one in value if isinstance(value, tuple) else (value,):
            assert shown_equals(shown, one), f"{fragment!r}: the page says {shown}, the file {one}"
    return found.span()


# ----------------------------------------------------------------------------------------------
# docs/analysis.md: results/analysis.json (and the 50- and 150-step studies), mean and spread over the seeds


STUDY = results("analysis.json")
COLUMNS = ("cwt", "ce head fine-tune", "ce")  # the table's columns: CWT, its fine-tune, CE


def runs(objective: str, study: list[dict] = STUDY) -> list[dict]:
    return [r for r in study if r["objective"] == objective]


def mean(objective: str, value: Callable[[dict], float], study: list[dict] = STUDY) -> float:
    values = [value(r) for r in runs(objective, study)]
    return sum(values) / len(values)


def spread(objective: str, value: Callable[[dict], float]) -> float:
    """Half the difference of the two seeds' values."""
    first, second = (value(r) for r in runs(objective))
    return abs(first - second) / 2


def key(name: str) -> Callable[[dict], float]:
    return lambda r: r[name]


def in_bin(low: int, name: str) -> Callable[[dict], float]:
    """The bin whose counts start at `low`; -1: the last (the most frequent tokens)."""
    return lambda r: r["frequency_bins"][-1][name] if low == -1 else next(
        b[name] for b in r["frequency_bins"] if b["min_count"] == low)


def unseen_shrinkage(r: dict) -> float:
    """An absent token's row, under decay alone, moves radially: its drift over its initial norm, in %."""
    b = r["frequency_bins"][0]
    return 100 * b["mean_drift"] / (b["mean_norm"] + b["mean_drift"])


def decay_alone(steps: int) -> float:
    """AdamW's decoupled decay over the tiny preset's schedule of `steps` steps, 1 - prod (1 - lr_t wd), in %."""
    cfg = plan.with_schedule(train.TrainConfig(max_iters=steps), {})
    return 100 * (1 - math.prod(1 - plan.lr_at(t, cfg) * cfg.weight_decay for t in range(steps)))


def first_bin(low: int) -> dict:
    return next(b for b in STUDY[0]["frequency_bins"] if b["min_count"] == low)


def bin_range(low: int) -> str:
    b = first_bin(low)
    return f"{b['min_count']:,}-{b['max_count']:,}"


CWT_INIT_NORM = mean("cwt", in_bin(0, "mean_norm")) + mean("cwt", in_bin(0, "mean_drift"))  # shrunk radially
TOP = STUDY[0]["frequency_bins"][-1]

# The results table: a row's label (its figures from the file), then its value in each checkpoint's row
TABLE = [
    ("training loss (its own objective)", [], key("loss")),
    ("val CE", [], key("val_ce")),
    ("anisotropy E, seen tokens", [], key("embedding_anisotropy")),
    ("anisotropy E, all {} ids", [STUDY[0]["vocab_size"]], key("embedding_anisotropy_all")),
    ("anisotropy, hidden states", [], key("hidden_anisotropy")),
    ("effective rank E, seen (of {})", [len(STUDY[0]["embedding_singular_values"])], key("embedding_effective_rank")),
    ("effective rank E, all ids", [], key("embedding_effective_rank_all")),
    ("effective rank, hidden states", [], key("hidden_effective_rank")),
    ("IsoScore E, seen", [], key("embedding_isoscore")),
    ("IsoScore, hidden states", [], key("hidden_isoscore")),
    ("drift of E's rows: not in the split ({} ids)", [first_bin(0)["tokens"]], in_bin(0, "mean_drift")),
    (f"drift: in the split {bin_range(1)} times ({{}})", [first_bin(1)["tokens"]], in_bin(1, "mean_drift")),
    (f"drift: {bin_range(10)} times ({{}})", [first_bin(10)["tokens"]], in_bin(10, "mean_drift")),
    (f"drift: {bin_range(100)} times ({{}})", [first_bin(100)["tokens"]], in_bin(100, "mean_drift")),
    (f"drift: {bin_range(1000)} times ({{}})", [first_bin(1000)["tokens"]], in_bin(1000, "mean_drift")),
    ("drift: the most frequent token ({} times)", [TOP["max_count"]], in_bin(-1, "mean_drift")),
    ("norm of E's rows: not in the split (init {})", [CWT_INIT_NORM], in_bin(0, "mean_norm")),
    ("val CE of targets not in the split ({} positions)", [first_bin(0)["val_positions"]], in_bin(0, "val_ce")),
    (f"val CE of targets in the split {bin_range(1)} times ({{}})", [first_bin(1)["val_positions"]],
     in_bin(1, "val_ce")),
    (f"val CE of targets in the split {bin_range(10)} times ({{}})", [first_bin(10)["val_positions"]],
     in_bin(10, "val_ce")),
    (f"val CE of targets in the split {bin_range(1000)} times ({{}})", [first_bin(1000)["val_positions"]],
     in_bin(1000, "val_ce")),
    ("val CE of the most frequent target ({})", [TOP["val_positions"]], in_bin(-1, "val_ce")),
]


def neighbour_words(objectives: tuple[str, ...], word: str) -> set[str]:
    return {n.strip() for o in objectives for r in runs(o) for n in r["neighbours"][word]}


def listed(words) -> str:
    words = sorted(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


def king_sentence() -> str:
    firsts = [(r["neighbours"]["king"][0].strip(), r["objective"]) for r in STUDY]
    world = sum(first == "world" for first, _ in firsts)
    (other, objective), = [f for f in firsts if f[0] != "world"]
    kind = {"ce": "a CE one", "cwt": "a CWT one", "ce head fine-tune": "a fine-tune"}[objective]
    return (f"king's nearest is world in {WORDS[world]} of the {WORDS[len(firsts)]} checkpoints ({other} in the "
            f"{'sixth' if len(firsts) == 6 else '?'}, {kind})")


def sweet_sentence() -> str:
    ce = neighbour_words(("ce",), "sweet")
    cwt = neighbour_words(("cwt", "ce head fine-tune"), "sweet")
    assert ce <= cwt  # "from those and ..."
    return (f"sweet's are drawn from {listed(ce)} under CE, and from those and {listed(cwt - ce)} under CWT and its "
            "fine-tune")


SHORTER = {steps: results(f"analysis-{steps}.json") for steps in (50, 150)}
CWT_HIDDEN = [mean("cwt", key("hidden_anisotropy"), study) for study in (*SHORTER.values(), STUDY)]
SEEDS = len(runs("cwt"))
STEPS = runs("cwt")[0]["step"]
FT_STEPS = runs("ce head fine-tune")[0]["step"]
VOCAB = STUDY[0]["vocab_size"]
cwt, ft, ce = (lambda value, o=o: mean(o, value) for o in COLUMNS)

# The Results section's sentences, each figure from the file
ANALYSIS = [
    ("Figures are the mean ± the spread over the {} seeds", [SEEDS]),
    ("with {} seeds even that is a weak test", [SEEDS]),
    ("the validation figures are over the first {} positions of the validation split", [STUDY[0]["positions"]]),
    (f"a token of the split's {bin_range(1)} bin may not have been read by a run's {{}} micro-batches either",
     [STEPS]),
    ("the anisotropy over all ids stays at its random-init value (~{})", [cwt(key("embedding_anisotropy_all"))]),
    ("| measure | CWT ({} steps) | + head fine-tune | CE ({} steps) |", [STEPS, runs("ce")[0]["step"]]),
    ("(The tokens per bin: {} ids absent from the split, then {} / {} / {} / {} / {} / {} present "
     + " / ".join(f"{b['min_count']:,}-{b['max_count']:,}" for b in STUDY[0]["frequency_bins"][1:-1])
     + f" / {TOP['min_count']:,}+ times in its {{}} tokens.",
     [b["tokens"] for b in STUDY[0]["frequency_bins"]] + [(*(r["train_tokens"] for r in STUDY),)]),
    ("log {} = {}", [VOCAB, math.log(VOCAB)]),
    ("{} training tokens read, the README's {} steps", [(*(r["tokens"] for r in runs("cwt") + runs("ce")),), STEPS]),
    ("drifts by {}, all of it radial shrinkage: {}% of its norm in both seeds", [
        cwt(in_bin(0, "mean_drift")), (*(unseen_shrinkage(r) for r in runs("cwt")),)]),
    ("over the {} steps' learning rates, predicts {}%", [STEPS, decay_alone(STEPS)]),
    ("The fine-tune adds its own {} steps of decay ({}%)", [FT_STEPS, (*map(unseen_shrinkage, runs(COLUMNS[1])),)]),
    (f"Drift under CWT rises with a token's count in the split up to the {bin_range(1000)} bin ({{}}, {{}}, {{}}, "
     "{}, {} by decade)", [cwt(in_bin(low, "mean_drift")) for low in (0, 1, 10, 100, 1000)]),
    (f"the {{}} tokens present {bin_range(10000)} times drift a little less ({{}} ± {{}}), the most frequent one "
     "more ({})", [first_bin(10000)["tokens"], cwt(in_bin(10000, "mean_drift")),
                   spread("cwt", in_bin(10000, "mean_drift")), cwt(in_bin(-1, "mean_drift"))]),
    ("Under CE an unseen row drifts {}", [ce(in_bin(0, "mean_drift"))]),
    ("farther than the most frequent token's row ({})", [ce(in_bin(-1, "mean_drift"))]),
    (f"drift falls with frequency down to {{}} for tokens present {bin_range(100)} times in the split (less than "
     "CWT's {} there)", [ce(in_bin(100, "mean_drift")), cwt(in_bin(100, "mean_drift"))]),
    ("(norm {} to {})", [CWT_INIT_NORM, ce(in_bin(0, "mean_norm"))]),
    ("the anisotropy over all ids ({}) exceeds the one over the seen tokens ({})",
     [ce(key("embedding_anisotropy_all")), ce(key("embedding_anisotropy"))]),
    ("E's effective rank over all ids falls from {} to {}", [len(STUDY[0]["embedding_singular_values"]),
                                                             ce(key("embedding_effective_rank_all"))]),
    ("(IsoScore {} against {})", [cwt(key("embedding_isoscore")), ce(key("embedding_isoscore"))]),
    ("({} ± {} against {} ± {})", [cwt(key("hidden_anisotropy")), spread("cwt", key("hidden_anisotropy")),
                                   ce(key("hidden_anisotropy")), spread("ce", key("hidden_anisotropy"))]),
    ("(effective rank {} against {})", [cwt(key("hidden_effective_rank")), ce(key("hidden_effective_rank"))]),
    ("the same study stopped at {} and {} steps (`results/analysis-{}.json`, `analysis-{}.json`",
     [runs("cwt", SHORTER[50])[0]["step"], runs("cwt", SHORTER[150])[0]["step"], 50, 150]),
    ("had CE's hidden anisotropy at {}, then {}, while CWT's stayed at {}-{}",
     [mean("ce", key("hidden_anisotropy"), SHORTER[50]), mean("ce", key("hidden_anisotropy"), SHORTER[150]),
      min(CWT_HIDDEN), max(CWT_HIDDEN)]),
    ("which trains the whole model for {} steps", [FT_STEPS]),
    ("anisotropy {}, effective rank {}, about CE's", [ft(key("hidden_anisotropy")), ft(key("hidden_effective_rank"))]),
    ("({} against {} on the most frequent)", [ce(in_bin(-1, "val_ce")), cwt(in_bin(-1, "val_ce"))]),
    ("({} against {}, {} against {})", [ce(in_bin(0, "val_ce")), cwt(in_bin(0, "val_ce")),
                                        ce(in_bin(1, "val_ce")), cwt(in_bin(1, "val_ce"))]),
    ("less than the uniform share ({})", [math.log(VOCAB)]),
    (f"On the targets present {bin_range(10)} times the two are close ({{}} ± {{}} for CWT, {{}} ± {{}} for CE",
     [cwt(in_bin(10, "val_ce")), spread("cwt", in_bin(10, "val_ce")), ce(in_bin(10, "val_ce")),
      spread("ce", in_bin(10, "val_ce"))]),
    ("The head fine-tune's {} steps lower the CE of frequent targets ({} to {} on the most frequent)",
     [FT_STEPS, cwt(in_bin(-1, "val_ce")), ft(in_bin(-1, "val_ce"))]),
    ("raise it slightly on the rare ones ({} to {})", [cwt(in_bin(1, "val_ce")), ft(in_bin(1, "val_ce"))]),
    ("Neighbours: no difference at {} steps", [STEPS]),
    (king_sentence(), []),
    (sweet_sentence(), []),
    ("(At {} steps CE's neighbours were frequent", [runs("ce", SHORTER[150])[0]["step"]]),
    ("(CE's validation CE {}; CWT's through E {}, its fine-tune's {})",
     [ce(key("val_ce")), cwt(key("val_ce")), ft(key("val_ce"))]),
]

# Figures of the Results section that come from elsewhere than a results file, and why
NOT_FROM_RESULTS = [
    "(7.2M parameters",  # the model's size, as train.py prints it (tiny preset), not a measure of the study
    "1 - prod_t (1 - lr_t x 0.1)",  # the formula: weight decay 0.1 (train.OPTIMIZER_DEFAULTS)
    "At the paper's 143,000 steps",  # the paper's schedule, and what decay alone does over it (0.08%):
    "to 0.08% of their norm",  # "Why the paper's argument predicts a difference" derives it
]


def results_section(text: str) -> str:
    return text[text.index("## Results"):text.index("## On a GPU")]


def check_analysis(text: str) -> None:
    section = flat(results_section(text))
    claimed = []
    for label, label_values, value in TABLE:
        claimed.append(table_row(section, label, label_values, value))
    for fragment, values in ANALYSIS:
        claimed.append(find_figures(section, fragment, values))
    for fragment in NOT_FROM_RESULTS:
        start = section.index(fragment)
        claimed.append((start, start + len(fragment)))
    loose = [m.group() for m in re.finditer(NUMBER, section)
             if not any(a <= m.start() and m.end() <= b for a, b in claimed)]
    assert not loose, f"figures in analysis.md's Results tied to no results file: {loose}"


def table_row(section: str, label: str, label_values: list, value: Callable[[dict], float]) -> tuple[int, int]:
    """A row of the results table: its label's figures, then mean ± spread of each column, as the file has them."""
    start, _ = find_figures(section, f"| {label} |", label_values)
    cells = re.match(r"\|[^|]*\|([^|]*)\|([^|]*)\|([^|]*)\|", section[start:])
    assert cells, label
    for cell, objective in zip(cells.groups(), COLUMNS):
        shown = re.match(rf"\s*({NUMBER}) ± ({NUMBER})", cell)
        assert shown, f"{label}: {cell!r}"
        assert shown_equals(shown.group(1), mean(objective, value)), f"{label} ({objective}): {cell}, file " \
            f"{mean(objective, value)}"
        assert shown_equals(shown.group(2), spread(objective, value)), f"{label} ({objective}): {cell}, file " \
            f"{spread(objective, value)}"
    return start, start + cells.end()


def test_analysis_md_says_what_its_results_file_holds():
    check_analysis((ROOT / "docs" / "analysis.md").read_text())


def test_the_drift_sentences_hold_in_the_file():
    """What analysis.md says of the shape of CWT's drift by bin: a rise up to the 1,000-9,999 bin in both seeds,
    the 10,000-99,999 bin below it, the most frequent token above."""
    for r in runs("cwt"):
        drift = [b["mean_drift"] for b in r["frequency_bins"]]
        assert drift[:5] == sorted(drift[:5]) and drift[5] < drift[4] < drift[6]


def test_a_figure_that_disagrees_with_the_file_fails():
    text = (ROOT / "docs" / "analysis.md").read_text()
    wrong = text.replace("in its 1,373,559 tokens", "in its 1,430,000 tokens")
    with pytest.raises(AssertionError, match="the page says 1,430,000"):
        check_analysis(wrong)
    untied = text.replace("The uniform guess", "At 1.45M tokens, the uniform guess")
    with pytest.raises(AssertionError, match=r"tied to no results file: \['1.45'\]"):
        check_analysis(untied)


# ----------------------------------------------------------------------------------------------
# docs/benchmarks.md: compare.py's run (results/compare.json); docs/negatives.md: results/negatives.json


COMPARE = results("compare.json")


def test_benchmarks_md_says_what_compare_json_holds():
    text = flat((ROOT / "docs" / "benchmarks.md").read_text())
    runs_, iters = COMPARE["runs"], COMPARE["iters"]
    budget = COMPARE["budget_flops"]
    rows = [("| CE (tied head) | {} | {} | {}e{} | {} | {} | {} | {} |", "ce", iters["ce"]),
            ("| CWT, raw (scored with tied E) | {} | {} | {}e{} | {} | {} | {} | {} |", "cwt", iters["cwt"])]
    for fragment, name, steps in rows:
        run = runs_[name]
        mantissa, exponent = f"{run['flops']:.3e}".split("e")
        find_figures(text, fragment, [steps, run["tokens"], float(mantissa), int(exponent), run["flops"] / budget,
                                      run["seconds"], run["val_ce"], run["val_bpb"]])
    ft = runs_["cwt-ft"]
    mantissa, exponent = f"{ft['flops']:.3e}".split("e")
    find_figures(text, "| CWT + LM-head fine-tune | +{} | {} | {}e{} | {} | +{} | **{}** | **{}** |",
                 [iters["cwt-ft"], ft["tokens"], float(mantissa), int(exponent), ft["flops"] / budget,
                  ft["seconds"], ft["val_ce"], ft["val_bpb"]])
    find_figures(text, "CWT followed by the head fine-tune ends {} nats ({} bits per byte) below CE",
                 [runs_["ce"]["val_ce"] - ft["val_ce"], runs_["ce"]["val_bpb"] - ft["val_bpb"]])
    find_figures(text, "{} x {} tokens a step", [COMPARE["config"]["batch_size"], COMPARE["config"]["block_size"]])


NEGATIVES = results("negatives.json")


def test_negatives_md_table_says_what_negatives_json_holds():
    """Each row of the Results table, every cell: the setting, then each measure (± its std over the seeds)."""
    text = flat((ROOT / "docs" / "negatives.md").read_text())
    for r in NEGATIVES:
        pm = "{} ± {}"
        measured = [r["val_ce"], r["val_ce_std"], r["val_bpb"], r["val_bpb_std"]]
        if r["bpb_vs_ce"] is None:
            tail = " | - | - |"
        else:
            tail = f" | +{pm} | {pm} |"
            measured += [r["bpb_vs_ce"], r["bpb_vs_ce_std"], r["raw_val_bpb"], r["raw_val_bpb_std"]]
        mantissa, exponent = f"{r['flops']:.3e}".split("e")
        fragment = (f"| {r['series']} | {r['batch_size']} x {r['block_size']} | {r['label']} | {{}} | {{}} | "
                    f"{{}}e+{{}} | {pm} | {pm}{tail} {{}} | {{}} | {{}} |")
        find_figures(text, fragment, [r["candidates"], r["tokens"],
                                      float(mantissa), int(exponent), *measured, r["step_ms"], r["peak_mib"],
                                      r["seconds"] / 60])

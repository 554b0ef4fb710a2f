"""Fine-tune an encoder checkpoint on XNLI and score every language's test set (the paper's multilingual table).

    python xnli.py --ckpt=out-mlm/ckpt.safetensors                   # English fine-tune, all 15 test sets (zero-shot)
    python xnli.py --ckpt=out-mlm/ckpt.safetensors --train_lang=fr   # fine-tune on French (translated), score French
    python xnli.py --ckpt=out-mlm/ckpt.safetensors --train_lang=each --json=results/xnli.json  # each language in turn
    python xnli.py --ckpt=out-mlm/ckpt.safetensors --data=xnli_dir   # offline, see --data

Two settings, as the paper reports them (XNLI average, distilled-mBERT-shaped encoder):
  * --train_lang=en: fine-tune on the English training set (MultiNLI) and score every language's test
    set: zero-shot cross-lingual transfer;
  * --train_lang=xx: fine-tune on language xx's machine-translated training set and score xx's own test
    set; --train_lang=each does this for every language in turn, each from a fresh copy of the checkpoint
    (target-language fine-tuning, "translate-train").
The score is accuracy per language and their unweighted mean. Fractions in --json, percentages on screen.

Model, input and training are glue.py's, so XNLI and GLUE numbers come from one recipe: premise and
hypothesis joined by the end-of-text token (longest-first truncation to --max_length), a dropout + linear
head on the mean of the final hidden states, 3 labels (0 entailment, 1 neutral, 2 contradiction), AdamW
with linear warmup and decay, --epochs epochs, the test sets scored once after the last epoch (no
selection on them). The checkpoint's tokenizer is used as it is: a GPT-2 BPE splits most non-Latin
scripts into bytes, so a multilingual comparison wants a multilingual tokenizer at pre-training time.

Data: `facebook/xnli` from the hub (one config per language; splits train and test), or --data=DIR with
one folder per language (its name is the language code) holding train.jsonl and test.jsonl, one
{"premise": ..., "hypothesis": ..., "label": 0|1|2} per line. Only the files a run needs must exist."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import glue
from cli import config_path, parse_flags, within_ranges
from common import UserError, check_hub, first_line, run_main
from devices import pick_device, pick_dtype
from io_checks import declare_io
from load import load_source
from results import check_finite, jsonl_rows, write_json
from tokenizer import dataset_tokenizer
from train import TrainConfig

XNLI_HUB = "facebook/xnli"
XNLI_LANGUAGES = ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh")
LABELS = ("entailment", "neutral", "contradiction")  # label 0, 1, 2
NLI = glue.TASKS["mnli"]  # premise / hypothesis, 3 labels: XNLI is MultiNLI's format
EACH = "each"
DATA_HINT = ("--data=DIR needs one folder per language holding train.jsonl and test.jsonl, "
             'one {"premise": ..., "hypothesis": ..., "label": 0|1|2} per line')


@dataclass
class XnliConfig(glue.TuneSettings):
    train_lang: str = field(default="en", metadata={
        "help": "en: zero-shot transfer to every language; xx: fine-tune on xx; each: every xx in turn"})
    data: str | None = field(default=None, metadata={
        "help": "a folder with one folder per language (train.jsonl, test.jsonl); none: the hub"})
    langs: list[str] | None = field(default=None, metadata={
        "help": "only these languages: scored (en) or fine-tuned (each); none: all"})
    epochs: int = 2  # glue.py's rule and meaning (doors.field_meta), another default
    max_test_examples: int | None = field(default=None, metadata={
        "range": (1, 1 << 40), "help": "only the first N test examples per language (quick runs; not comparable)"})


# ---------------------------------------------------------------------------------------------- The score


def xnli_scores(pred_by_lang: dict[str, np.ndarray],
                gold_by_lang: dict[str, np.ndarray]) -> tuple[dict[str, float], float]:
    """({language: accuracy}, their unweighted mean): every language counts the same, whatever the size of
    its test set, as XNLI's average is reported."""
    if set(pred_by_lang) != set(gold_by_lang) or not gold_by_lang:
        raise ValueError(f"predictions for {sorted(pred_by_lang)} but gold labels for {sorted(gold_by_lang)}")
    accuracy = {}
    for lang, gold in gold_by_lang.items():
        pred = np.asarray(pred_by_lang[lang])
        if pred.shape != np.shape(gold):
            raise ValueError(f"{lang}: {pred.shape} predictions for {np.shape(gold)} gold labels")
        accuracy[lang] = glue.accuracy(pred, np.asarray(gold))
    return accuracy, float(np.mean(list(accuracy.values())))


# ---------------------------------------------------------------------------------------------- Languages and data


def known_languages(cfg: XnliConfig) -> list[str]:
    """XNLI's 15 languages, or with --data the names of DIR's folders (sorted)."""
    if not cfg.data:
        return list(XNLI_LANGUAGES)
    root = Path(cfg.data)
    if not root.is_dir():
        raise UserError(f"--data={cfg.data} is not a folder; {DATA_HINT}")
    langs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not langs:
        raise UserError(f"--data={cfg.data} holds no language folders; {DATA_HINT}")
    return langs


def plan_languages(cfg: XnliConfig, known: list[str]) -> list[tuple[str, list[str]]]:
    """The fine-tunes to run: (training language, the languages whose test sets it is scored on)."""
    where = f"the folders of {cfg.data}" if cfg.data else f"{XNLI_HUB}'s languages"
    for flag, codes in (("langs", cfg.langs or []), ("train_lang", [cfg.train_lang])):
        for code in codes:
            if code not in known and not (flag == "train_lang" and code == EACH):
                extra = " (or each)" if flag == "train_lang" else ""
                raise UserError(f"--{flag}: unknown language {code!r}; known ({where}): "
                                f"{', '.join(known)}{extra}")
    chosen = [lang for lang in known if lang in cfg.langs] if cfg.langs else known
    if cfg.train_lang == EACH:
        return [(lang, [lang]) for lang in chosen]
    if cfg.train_lang == "en":
        return [("en", chosen)]
    if cfg.langs:
        raise UserError(f"--langs applies to --train_lang=en (zero-shot) or each; --train_lang="
                        f"{cfg.train_lang} scores {cfg.train_lang}'s own test set only: drop --langs")
    return [(cfg.train_lang, [cfg.train_lang])]


def read_jsonl_split(path: Path) -> Iterator[tuple[str, Any]]:
    """(position: the file and line, row) of each non-blank line of a .jsonl file, through results.jsonl_rows."""
    if not path.is_file():
        raise UserError(f"{path} not found; {DATA_HINT}")
    for number, row in jsonl_rows(path, "XNLI file", "save the file as UTF-8 JSON lines"):
        yield f"{path} line {number}", row


def hub_split(lang: str, split: str) -> Iterator[tuple[str, Any]]:
    """(position, row) of one language's split of facebook/xnli, downloaded once into the datasets cache."""
    check_hub(f"hf:{XNLI_HUB}/{lang} {split}", f"pass --data=DIR ({DATA_HINT.removeprefix('--data=DIR ')})")
    try:
        import datasets  # imported here: slow, and --data runs never need it
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported below, in one line
        rows = datasets.load_dataset(XNLI_HUB, lang, split=split)
    except Exception as e:
        raise UserError(f"could not load hf:{XNLI_HUB}/{lang} {split}: {first_line(e).rstrip('.')}; "
                        f"offline? pass --data=DIR ({DATA_HINT.removeprefix('--data=DIR ')})") from None
    for number, row in enumerate(rows, 1):
        yield f"hf:{XNLI_HUB}/{lang} {split} example {number}", row


def check_row(row: Any, where: str) -> None:
    """A one-line error for a row that is not an XNLI example."""
    if not isinstance(row, dict):
        raise UserError(f"{where} is a JSON {type(row).__name__}, not an object with premise, hypothesis "
                        "and label")
    missing = [c for c in (*NLI.text, "label") if c not in row]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)} (has: {', '.join(row) or 'nothing'}); "
                        "each example needs premise, hypothesis and label")
    for column in NLI.text:
        if not isinstance(row[column], str):
            raise UserError(f"{where}: {column} must be text, got {row[column]!r}")
    label = row["label"]
    if type(label) is not int or label not in range(len(LABELS)):
        raise UserError(f"{where} has label {label!r}, not 0, 1 or 2 "
                        "(0 entailment, 1 neutral, 2 contradiction)")


def load_split(cfg: XnliConfig, lang: str, split: str, limit: int | None) -> tuple[list[dict], np.ndarray]:
    """The first `limit` (all: None) checked rows of one language's split, and their labels."""
    source = read_jsonl_split(Path(cfg.data) / lang / f"{split}.jsonl") if cfg.data else hub_split(lang, split)
    rows = []
    for where, row in source:
        if limit is not None and len(rows) >= limit:
            break
        check_row(row, where)
        rows.append(row)
    if not rows:
        where = Path(cfg.data) / lang / f"{split}.jsonl" if cfg.data else f"hf:{XNLI_HUB}/{lang} {split}"
        raise UserError(f"{where} holds no examples")
    return rows, np.array([row["label"] for row in rows], dtype=np.int64)


# ---------------------------------------------------------------------------------------------- Fine-tuning and scoring


def check_config(cfg: XnliConfig) -> None:
    """Refuse settings that cannot work before any work: each outside its field's range."""
    within_ranges(cfg)


def fine_tune(cfg: XnliConfig, ckpt: dict, lang: str, examples: list[list[int]], labels: np.ndarray,
              pad: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, list[float]]:
    """A fresh copy of the checkpoint with a new head, fine-tuned on one language; its mean training loss per epoch."""
    model = glue.load_encoder(cfg, ckpt, NLI, device)  # reads cfg.ckpt, cfg.dropout, cfg.seed
    losses = []
    for epoch, loss in glue.train_epochs(model, cfg, examples, labels, pad, device, dtype, f"xnli {lang}"):
        losses.append(loss)
        tqdm.write(f"{lang} epoch {epoch}: train loss {loss:.4f}", file=sys.stderr)
    return model, losses


def run_xnli(cfg: XnliConfig) -> dict:
    """Fine-tune and score as cfg.train_lang says; returns accuracy per language, the average and details."""
    check_config(cfg)
    plan = plan_languages(cfg, known_languages(cfg))
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    ckpt = load_source(cfg.ckpt, TrainConfig)  # read lazily: cheap, and a wrong path fails before any download
    meta = ckpt.data_meta
    tokenizer = dataset_tokenizer(ckpt)
    separator = meta.get("eot_token", tokenizer.eot_token)  # also the padding id: padding is masked out
    glue.check_token_ids(cfg.ckpt, ckpt, tokenizer, separator)
    max_length = min(cfg.max_length, ckpt.model_config.block_size)
    # Every test set, and with --data every later training file, is read and checked before the first
    # fine-tune: a bad row in the last language's file costs seconds, not hours.
    tests = {lang: load_split(cfg, lang, "test", cfg.max_test_examples) for _, langs in plan for lang in langs}
    if cfg.data:
        for train_lang, _ in plan[1:]:
            load_split(cfg, train_lang, "train", cfg.max_train_examples)

    def encode(rows: list[dict]) -> list[list[int]]:
        return glue.encode_rows(rows, NLI, tokenizer, separator, max_length)

    tests = {lang: (encode(rows), gold) for lang, (rows, gold) in tests.items()}
    preds, train_loss, train_examples, causal, start = {}, {}, {}, False, time.time()
    for train_lang, test_langs in plan:
        rows, labels = load_split(cfg, train_lang, "train", cfg.max_train_examples)
        examples = encode(rows)  # one training language in memory at a time
        del rows
        model, train_loss[train_lang] = fine_tune(cfg, ckpt, train_lang, examples, labels, separator,
                                                  device, dtype)
        train_examples[train_lang], causal = len(examples), model.config.causal
        del examples, labels
        for lang in test_langs:
            preds[lang] = glue.predict(model, tests[lang][0], cfg.batch_size, separator, device, dtype)
        del model
    accuracy, average = xnli_scores(preds, {lang: gold for lang, (_, gold) in tests.items()})
    return {"task": "xnli", "train_lang": cfg.train_lang,
            "setting": "zero-shot" if cfg.train_lang == "en" else "target-language",
            "accuracy": accuracy, "average": average, "checkpoint": cfg.ckpt,
            "data": cfg.data or f"hf:{XNLI_HUB}", "train_loss": train_loss, "train_examples": train_examples,
            "test_examples": {lang: len(examples) for lang, (examples, _) in tests.items()},
            "pooling": "mean", "causal_checkpoint": causal, "seconds": time.time() - start,
            "config": dataclasses.asdict(cfg)}


def main(argv: list[str]) -> dict:
    cfg = parse_flags(XnliConfig, argv)
    declare_io(reads={"--ckpt": cfg.ckpt, "--data": cfg.data, "--config": config_path(argv)},
               writes={"--json": cfg.json})
    result = run_xnli(cfg)
    cells = [f"{lang} {100 * acc:.2f}" for lang, acc in result["accuracy"].items()]
    check_finite(result, f"xnli of {cfg.ckpt}")
    print(f"xnli (train {cfg.train_lang}): " + " | ".join([*cells, f"average {100 * result['average']:.2f}"]))
    if cfg.json:
        write_json(cfg.json, result)
    return result


if __name__ == "__main__":
    run_main(main)

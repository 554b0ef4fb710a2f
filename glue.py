"""Fine-tune an encoder checkpoint on a GLUE task and score its validation split with GLUE's metric.

    python glue.py --ckpt=out-mlm/ckpt.safetensors --task=sst2                  # data from the hub (nyu-mll/glue)
    python glue.py --ckpt=out-mlm/ckpt.safetensors --task=rte --epochs=10 --lr=1e-4 --json=results/rte.json
    python glue.py --ckpt=out-mlm/ckpt.safetensors --task=mnli --data=glue/mnli  # offline, see --data

Input: a sentence, or a pair joined by the end-of-text token (GPT-2 has no [SEP]; end-of-text is the
boundary the encoder saw between documents and is never masked), cut to --max_length tokens (the longer
side of a pair loses its last tokens first, BERT's "longest_first").
Head: dropout and a linear layer on the mean of the final hidden states over the real tokens. Not a
[CLS] vector: pre-training has no [CLS] token and no sentence-level objective, so no single position is
trained to summarise the input, while every position's state is shaped by the (contrastive or CE) token
objective and, with bidirectional attention, has seen the whole input.
Training: AdamW (`model.adamw`: decay on matrices only), gradient clipping 1.0,
warmup over the first --warmup_fraction of the steps, then linear decay to zero, --epochs epochs;
cross-entropy, or mean squared error on one output for STS-B. The validation split is scored after
every epoch; the last epoch's scores are the result (no selection on the validation set).
Metrics (GLUE's): CoLA Matthews correlation; SST-2, QNLI, RTE, WNLI accuracy; MRPC, QQP F1 (of the
positive class) and accuracy; STS-B Pearson and Spearman; MNLI matched and mismatched accuracy. The
task `score` is their mean, as on the GLUE leaderboard. Fractions in --json, percentages on screen."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import Checkpoint, checkpoint_model
from cli import config_path, parse_flags, within_ranges
from common import UserError, check_hub, run_main
from devices import DeviceName, DtypeName, autocast_context, pick_device, pick_dtype
from doors import MAXIMA
from io_checks import declare_io
from load import load_source
from model import GPT, adamw
from results import check_finite, jsonl_rows, write_json
from tokenizer import dataset_tokenizer
from train import TrainConfig, optimizer_step

GLUE_HUB = "nyu-mll/glue"


@dataclass(frozen=True)
class Task:
    text: tuple[str, ...]  # the text column(s): one sentence or a pair
    num_labels: int  # 1: a regression (STS-B)
    metrics: tuple[str, ...]
    validation: tuple[str, ...] = ("validation",)  # the split(s) scored
    label_range: tuple[float, float] | None = None  # a regression's scale (STS-B: similarity 0 to 5)


TaskName = Literal["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"]
TASKS: dict[str, Task] = {
    "cola": Task(("sentence",), 2, ("matthews",)),
    "sst2": Task(("sentence",), 2, ("accuracy",)),
    "mrpc": Task(("sentence1", "sentence2"), 2, ("f1", "accuracy")),
    "qqp": Task(("question1", "question2"), 2, ("f1", "accuracy")),
    "stsb": Task(("sentence1", "sentence2"), 1, ("pearson", "spearman"), label_range=(0.0, 5.0)),
    "mnli": Task(("premise", "hypothesis"), 3, ("accuracy",),
                 ("validation_matched", "validation_mismatched")),
    "qnli": Task(("question", "sentence"), 2, ("accuracy",)),
    "rte": Task(("sentence1", "sentence2"), 2, ("accuracy",)),
    "wnli": Task(("sentence1", "sentence2"), 2, ("accuracy",)),
}


@dataclass
class TuneSettings:
    """Fine-tuning settings (glue.py's and xnli.py's)"""
    ckpt: str = field(default="out/ckpt.safetensors", metadata={
        "help": "an encoder checkpoint (train.py --objective=mlm)"})
    epochs: int = field(default=3, metadata={"range": (1, 1 << 20), "help": "passes over the training examples"})
    batch_size: int = field(default=32, metadata={"range": (1, 1 << 20), "help": "examples per optimizer step"})
    lr: float = field(default=5e-5, metadata={"range": (0, 10, "(]"), "help": "peak learning rate (AdamW)"})
    warmup_fraction: float = field(default=0.1, metadata={
        "range": (0, 1, "[)"), "help": "warmup over this share of the steps, then linear decay to zero"})
    weight_decay: float = field(default=0.01, metadata={"range": (0, math.inf),
                                                        "help": "AdamW's, on matrices only"})
    dropout: float = field(default=0.1, metadata={"range": (0, 1, "[)"),  # as BERT fine-tunes
                                                  "help": "dropout in the encoder and before the head"})
    max_length: int = field(default=128, metadata={"range": (2, MAXIMA["block_size"]),
                                                   "help": "tokens per example (at most the checkpoint's context)"})
    max_train_examples: int | None = field(default=None, metadata={
        "range": (1, 1 << 40), "help": "only the first N training examples (quick runs; not comparable)"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "auto: bfloat16 on CUDA (float16 without it), float32 on the CPU"})
    seed: int = field(default=0, metadata={"range": (0, 2**32 - 1),  # numpy's generators take no negative seed
                                           "help": "the head's initial weights, dropout, the examples' order"})
    json: str | None = field(default=None, metadata={"help": "also write the results to this file"})


@dataclass
class GlueConfig(TuneSettings):
    task: TaskName = field(default="sst2", metadata={"help": "the GLUE task"})
    data: str | None = field(default=None, metadata={
        "help": "a folder with train.jsonl and validation.jsonl (GLUE's columns); none: the hub"})


# --------------------------------------------------------- GLUE's metrics (plain numpy, so each can be checked by hand)


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(np.mean(pred == gold))


def f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """F1 of the positive class (label 1), as GLUE scores MRPC and QQP."""
    tp = np.sum((pred == 1) & (gold == 1))
    fp, fn = np.sum((pred == 1) & (gold != 1)), np.sum((pred != 1) & (gold == 1))
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def matthews(pred: np.ndarray, gold: np.ndarray) -> float:
    """Matthews correlation of binary labels; 0 when a row or column of the confusion matrix is empty."""
    tp, tn = np.sum((pred == 1) & (gold == 1)), np.sum((pred == 0) & (gold == 0))
    fp, fn = np.sum((pred == 1) & (gold == 0)), np.sum((pred == 0) & (gold == 1))
    denominator = math.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - np.mean(x), y - np.mean(y)
    denominator = math.sqrt(float(np.sum(x * x) * np.sum(y * y)))
    return float(np.sum(x * y) / denominator) if denominator else 0.0


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, group, counts = np.unique(x, return_inverse=True, return_counts=True)
    return np.bincount(group, weights=ranks)[group] / counts[group]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def task_metrics(task: Task, split: str, pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """{metric: value} of one validation split; MNLI's are suffixed _matched / _mismatched."""
    suffix = split.removeprefix("validation")
    return {name + suffix: METRICS[name](pred, gold) for name in task.metrics}


# -------------------------------------------------------------------------- Data: rows with GLUE's columns -> token ids


def read_rows(path: Path) -> list[dict]:
    """One JSON object per line, read line by line through its door (results.jsonl_rows)."""
    if not path.is_file():
        raise UserError(f"{path} not found; --data=DIR needs train.jsonl and the validation split(s) "
                        "in GLUE's columns (MNLI: validation_matched.jsonl, validation_mismatched.jsonl)")
    return [row for _, row in jsonl_rows(path, "GLUE file", "pass .jsonl files of GLUE's columns")]


def load_split(cfg: GlueConfig, split: str) -> list[dict]:
    if cfg.data:
        return read_rows(Path(cfg.data) / f"{split}.jsonl")
    from corpora import load  # the datasets library, through the real-corpora extra
    check_hub(f"{GLUE_HUB} {cfg.task} {split}", "pass --data=DIR with .jsonl files")  # offline: in seconds
    rows = load(f"{GLUE_HUB} {cfg.task} {split}", "offline? pass --data=DIR with .jsonl files",
                         GLUE_HUB, cfg.task, split=split)
    return rows.to_list()


def check_rows(rows: list[dict], task: Task, where: str) -> np.ndarray:
    """The labels of rows that hold the task's columns; a one-line error for anything else."""
    if not rows:
        raise UserError(f"{where} holds no examples")
    columns = (*task.text, "label")
    for number, row in enumerate(rows, 1):
        missing = [c for c in columns if not isinstance(row, dict) or c not in row]
        if missing:
            present = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise UserError(f"{where} example {number} lacks {', '.join(missing)} (has: {present}); "
                            f"this task needs {', '.join(columns)}")
        if not all(isinstance(row[c], str) for c in task.text):
            raise UserError(f"{where} example {number}: {' and '.join(task.text)} must be text")
        label = row["label"]
        if task.num_labels == 1:  # a finite number (json reads NaN and Infinity), on the task's scale
            low, high = task.label_range or (-math.inf, math.inf)
            valid = isinstance(label, (int, float)) and low <= label <= high and \
                (isinstance(label, int) or math.isfinite(label))
            expected = f"a number in [{low:g}, {high:g}]" if task.label_range else "a finite number"
        else:
            valid, expected = label in range(task.num_labels), f"0..{task.num_labels - 1}"
        if not valid or isinstance(label, bool):
            shown = repr(label) if len(repr(label)) <= 60 else repr(label)[:60] + "..."
            raise UserError(f"{where} example {number} has label {shown}, not {expected} "
                            "(GLUE's test splits carry no labels: score the validation split)")
    return np.array([row["label"] for row in rows], dtype=np.float64 if task.num_labels == 1 else np.int64)


def truncate_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """BERT's longest_first: take the last token off the longer side (the second on a tie) until both fit."""
    la, lb = len(a), len(b)
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


def encode_rows(rows: list[dict], task: Task, tokenizer, separator: int, max_length: int) -> list[list[int]]:
    """Token ids of each example: `a`, or `a <separator> b`, at most max_length long (never empty)."""
    parts = [tokenizer.encode_ordinary_batch([row[c] for row in rows]) for c in task.text]
    if len(parts) == 1:
        examples = [ids[:max_length] for ids in parts[0]]
    else:
        pairs = (truncate_pair(a, b, max_length - 1) for a, b in zip(*parts))
        examples = [a + [separator] + b for a, b in pairs]
    return [ids or [separator] for ids in examples]


def padded_batch(examples: list[list[int]], rows: np.ndarray, pad: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of some examples, right-padded to the longest; mask is True at real tokens."""
    lengths = torch.tensor([len(examples[i]) for i in rows])
    ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
    for r, i in enumerate(rows):
        ids[r, :len(examples[i])] = torch.tensor(examples[i])
    mask = torch.arange(ids.size(1))[None, :] < lengths[:, None]
    return ids.to(device), mask.to(device)


# ------------------------------------------------------- Model: the encoder plus a small head on its mean-pooled states


def add_classifier(model: GPT, num_labels: int, dropout: float) -> None:
    """Dropout and a linear layer on the pooled states, registered on the encoder so that its optimizer
    (`model.adamw`), `.to()` and `.train()` cover them. BERT's initialisation: N(0, 0.02), bias 0."""
    head = nn.Linear(model.config.d_model, num_labels)
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    model.classifier = nn.Sequential(nn.Dropout(dropout), head)


def classify(model: GPT, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores (B, num_labels), in fp32, from the mean of the final hidden states over the real tokens."""
    h = model.hidden(ids, pad_mask=mask)
    weights = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * weights).sum(dim=1) / weights.sum(dim=1)
    return model.classifier(pooled).float()


def task_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if scores.size(1) == 1:  # regression
        return F.mse_loss(scores.squeeze(1), labels.float())
    return F.cross_entropy(scores, labels)


def linear_schedule(step: int, warmup: int, total: int) -> float:
    """Learning-rate multiplier: linear warmup to 1 over `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def predict(model: GPT, examples: list[list[int]], batch_size: int, pad: int, device: torch.device,
            dtype: torch.dtype) -> np.ndarray:
    """Predicted labels (or regression values) of every example, in order."""
    model.eval()
    order = np.argsort([len(e) for e in examples], kind="stable")  # similar lengths together: less padding
    out = np.empty(len(examples))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        ids, mask = padded_batch(examples, rows, pad, device)
        with autocast_context(device, dtype):
            scores = classify(model, ids, mask)
        out[rows] = (scores.squeeze(1) if scores.size(1) == 1 else scores.argmax(dim=1)).cpu().numpy()
    model.train()
    return out


# ---------------------------------------------------------------------------------------------- Fine-tuning


def check_config(cfg: GlueConfig) -> None:
    within_ranges(cfg)


def load_encoder(cfg: GlueConfig, ckpt: dict, task: Task, device: torch.device) -> GPT:
    """The checkpoint's model with a fresh head; a causal one is fine-tuned as it is, with a warning."""
    model = checkpoint_model(ckpt, cfg.ckpt, dropout=cfg.dropout)
    if model.config.causal:
        print(f"warning: {cfg.ckpt} is a causal decoder, not an encoder: fine-tuning it with causal "
              "attention (pre-train with train.py --objective=mlm for the paper's encoders)", file=sys.stderr)
    torch.manual_seed(cfg.seed)
    add_classifier(model, task.num_labels, cfg.dropout)
    return model.to(device)


def evaluate_splits(model: GPT, task: Task, validation: dict, cfg: GlueConfig, pad: int,
                    device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    metrics = {}
    for split, (examples, gold) in validation.items():
        pred = predict(model, examples, cfg.batch_size, pad, device, dtype)
        metrics.update(task_metrics(task, split, pred, gold))
    return {**metrics, "score": float(np.mean(list(metrics.values())))}


def split_name(cfg: GlueConfig, split: str) -> str:
    """Where a split's rows come from, for messages: its .jsonl file, or the hub dataset."""
    return str(Path(cfg.data) / f"{split}.jsonl") if cfg.data else f"hf:{GLUE_HUB}/{cfg.task} {split}"


def check_token_ids(path: str, ckpt: Checkpoint, tokenizer, separator: object) -> None:
    """The separator (data_meta's eot_token, also the padding id) and the tokenizer's ids must be token ids of
    the model's vocabulary, or the embedding lookup fails mid-training."""
    vocab = ckpt.model_config.vocab_size
    if isinstance(separator, bool) or not isinstance(separator, int) or not 0 <= separator < vocab:
        raise UserError(f"{path}: data_meta eot_token {separator!r} is not a token id of the model's "
                        f"vocabulary (0..{vocab - 1}), and fine-tuning separates and pads with it; fix the "
                        "checkpoint's data_meta or train on data prepared with its tokenizer")
    if tokenizer.n_vocab > vocab:
        raise UserError(f"{path}: its tokenizer ({getattr(tokenizer, 'name', '?')}) has {tokenizer.n_vocab} "
                        f"tokens but the model only {vocab}; use the tokenizer the model was trained with")


def fine_tune(cfg: GlueConfig) -> dict:
    """Fine-tune cfg.ckpt on cfg.task; returns the validation metrics after each epoch and at the end."""
    check_config(cfg)
    task = TASKS[cfg.task]
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    ckpt = load_source(cfg.ckpt, TrainConfig)
    meta = ckpt.data_meta
    tokenizer = dataset_tokenizer(ckpt)
    separator = meta.get("eot_token", tokenizer.eot_token)  # also the padding id: padding is masked out
    check_token_ids(cfg.ckpt, ckpt, tokenizer, separator)
    max_length = min(cfg.max_length, ckpt.model_config.block_size)
    where = cfg.data or f"hf:{GLUE_HUB}/{cfg.task}"
    train_rows = load_split(cfg, "train")[:cfg.max_train_examples]
    train_labels = check_rows(train_rows, task, split_name(cfg, "train"))
    train_examples = encode_rows(train_rows, task, tokenizer, separator, max_length)
    validation = {}
    for split in task.validation:
        rows = load_split(cfg, split)
        labels = check_rows(rows, task, split_name(cfg, split))  # before encoding: a bad row is one line
        validation[split] = (encode_rows(rows, task, tokenizer, separator, max_length), labels)
    model = load_encoder(cfg, ckpt, task, device)
    history, start = [], time.time()
    for epoch, train_loss in train_epochs(model, cfg, train_examples, train_labels, separator, device, dtype,
                                          f"glue {cfg.task}"):
        metrics = evaluate_splits(model, task, validation, cfg, separator, device, dtype)
        history.append({"epoch": epoch, "train_loss": train_loss, **metrics})
        tqdm.write(f"epoch {epoch}: train loss {train_loss:.4f} | "
                   + " | ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items()), file=sys.stderr)
    return {"task": cfg.task, "checkpoint": cfg.ckpt, "data": where, **history[-1],
            "metric_names": task.metrics, "history": history, "train_examples": len(train_examples),
            "validation_examples": {s: len(v[0]) for s, v in validation.items()}, "pooling": "mean",
            "causal_checkpoint": model.config.causal, "seconds": time.time() - start,
            "config": dataclasses.asdict(cfg)}


def train_epochs(model: GPT, cfg: GlueConfig, examples: list[list[int]], labels: np.ndarray, pad: int,
                 device: torch.device, dtype: torch.dtype, desc: str) -> Iterator[tuple[int, float]]:
    """cfg.epochs passes over the examples, each in an order drawn from (cfg.seed, epoch), with AdamW and a linear
    warmup and decay (glue.py's and xnli.py's fine-tune); yields (epoch, its mean training loss) after each."""
    optimizer = adamw(model, cfg.lr, cfg.weight_decay, (0.9, 0.999))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_fraction * total)
    step = 0
    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr)
    model.train()
    for epoch in range(1, cfg.epochs + 1):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(examples))
        loss_sum = 0.0
        for b in range(steps_per_epoch):
            rows = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
            loss_sum += train_batch(model, optimizer, examples, labels, rows, pad, device, dtype,
                                    cfg.lr * linear_schedule(step, warmup, total), scaler)
            step += 1
            bar.update()
            bar.set_postfix_str(f"loss {loss_sum / (b + 1):.4f}", refresh=False)
        yield epoch, loss_sum / steps_per_epoch
    bar.close()


def train_batch(model: GPT, optimizer: torch.optim.Optimizer, examples: list[list[int]], labels: np.ndarray,
                rows: np.ndarray, pad: int, device: torch.device, dtype: torch.dtype, lr: float,
                scaler: torch.amp.GradScaler) -> float:
    """One AdamW step on some examples (fp16: with loss scaling); returns their loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    ids, mask = padded_batch(examples, rows, pad, device)
    with autocast_context(device, dtype):
        loss = task_loss(classify(model, ids, mask), torch.from_numpy(labels[rows]).to(device))
    scaler.scale(loss).backward()
    optimizer_step(optimizer, model.parameters(), 1.0, scaler)
    return loss.item()


def main(argv: list[str]) -> dict:
    cfg = parse_flags(GlueConfig, argv)
    declare_io(reads={"--ckpt": cfg.ckpt, "--data": cfg.data, "--config": config_path(argv)},
               writes={"--json": cfg.json})
    result = fine_tune(cfg)
    shown = [k for k in result if k.split("_")[0] in METRICS or k == "score"]
    check_finite({k: result[k] for k in shown}, f"{cfg.task} of {cfg.ckpt}")
    print(f"{cfg.task}: " + " | ".join(f"{k} {100 * result[k]:.2f}" for k in shown))
    if cfg.json:
        write_json(cfg.json, result)
    return result


if __name__ == "__main__":
    run_main(main)

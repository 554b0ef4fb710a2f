"""Evaluate a checkpoint: zero-shot LAMBADA (OpenAI version) accuracy and perplexity, or validation loss.

    python eval.py --ckpt=out/ckpt.safetensors                             # lambada_openai test split (5153 texts)
    python eval.py --ckpt=out/ckpt.safetensors --data=lambada_test.jsonl   # offline: one {"text": ...} per line
    python eval.py --ckpt=out/ckpt.safetensors --task=val --json=val.json  # loss/perplexity on the checkpoint's data

Every kind of checkpoint is scored the way `model(idx)` scores it: through the LM head if it has one
(fine-tuned headless, the `nce` ablation), else against the tied input embeddings (CE, raw headless).

The LAMBADA numbers follow EleutherAI's lm-evaluation-harness task `lambada_openai`, so they can be set
next to published ones. Facts taken from the harness (lm_eval/tasks/lambada/lambada_openai.yaml,
lm_eval/models/huggingface.py `loglikelihood`/`_encode_pair`/`_loglikelihood_tokens`, lm_eval/api/metrics.py):
  * context = `" ".join(text.split(" ")[:-1])`, target = `" " + text.split(" ")[-1]` (no extra delimiter);
  * trailing whitespace of the context moves to the front of the target; the target's tokens are the
    tokens of encode(context + target) after the first len(encode(context)); no BOS is added;
  * an empty context is replaced by the end-of-text token, and the target is then encoded on its own;
  * the model reads (context + target)[-(window + 1):][:-1], so long contexts keep their last tokens;
  * an example is correct when the argmax of the log-softmax equals the target token at every target
    position (teacher forcing); its log-likelihood is the sum of the target tokens' log-probabilities;
  * acc = mean over examples of correct; perplexity = exp(-mean over examples of the log-likelihood).
Log-softmax (in fp32) covers every column of the model's output, as the harness does for Pythia's padded
vocabulary. Batches are right-padded: under causal attention pads never reach a scored position."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import Checkpoint, checkpoint_model
from cli import config_path, parse_flags, refuse_idle, within_ranges
from common import UserError, check_hub as common_check_hub, first_line, format_metric, run_main
from data import (
    ValSplit,
    dataset_dir,
    load_meta,
    open_split,
    open_val_split,
    recorded_dataset,
    same_tokenizer,
    special_ids,
)
from devices import DeviceName, DtypeName, autocast_context, pick_device, pick_dtype
from io_checks import declare_io
from load import load_source
from loss import NotFinite
from prepare import ensure_dataset
from results import check_finite, jsonl_rows, write_json
from tokenizer import dataset_tokenizer
from train import TrainConfig, Validation, evaluate, objective_of

LAMBADA_HUB = ("EleutherAI/lambada_openai", "default", "test")  # dataset id, config, split: 5153 texts


@dataclass
class EvalConfig:
    ckpt: str = field(default="out/ckpt.safetensors", metadata={"help": "a train.py or finetune.py checkpoint"})
    task: Literal["lambada", "val"] = field(default="lambada", metadata={
        "help": "lambada: last-word accuracy and perplexity; val: the validation metrics of a prepared dataset"})
    data: str | None = field(default=None, metadata={
        "help": "lambada: a local .jsonl ({\"text\": ...} per line); none: the hub dataset"})
    batch_size: int | None = field(default=None, metadata={
        "range": (1, 1 << 20), "help": "lambada: examples a pass (none: 16); val: none: the checkpoint's micro-batch"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="float32", metadata={  # as lm-evaluation-harness
        "help": "float32; bfloat16 or float16 (autocast) on request; auto: as train.py's"})
    max_examples: int | None = field(default=None, metadata={
        "range": (1, 1 << 40), "help": "lambada: only the first N texts (quick runs; not comparable)"})
    split: Literal["train", "val"] = field(default="val", metadata={
        "help": "val: which split of the checkpoint's dataset"})
    dataset: str | None = field(default=None, metadata={
        "help": "val: a prepared dataset under --data_root; none: the checkpoint's"})
    data_root: str = field(default="data", metadata={  # never taken from the checkpoint
        "help": "val: where datasets are read and prepared"})
    max_batches: int | None = field(default=None, metadata={
        "range": (1, 1 << 40), "help": "val: stop after this many batches; none: the whole split"})
    json: str | None = field(default=None, metadata={"help": "also write the results to this file"})


LAMBADA_BATCH = 16


# ------------------------------------------------------------------------------------ LAMBADA: the harness's definition


def split_context_target(text: str) -> tuple[str, str]:
    """lambada_openai's doc_to_text and doc_to_target: the text before its last space, and " " + last word."""
    *head, last = text.split(" ")
    return " ".join(head), " " + last


def _encode(tokenizer, text: str) -> list[int]:
    # Like a Hugging Face tokenizer, "<|endoftext|>" written in the text is the special token.
    return tokenizer.encode(text, allowed_special="all")


def encode_example(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(context tokens, target tokens) exactly as the harness builds them for a GPT-2-style tokenizer."""
    context, target = split_context_target(text)
    if context == "":
        return [tokenizer.eot_token], _encode(tokenizer, target)
    stripped = context.rstrip()  # trailing whitespace belongs to the target
    context, target = stripped, context[len(stripped):] + target
    context_ids = _encode(tokenizer, context)
    whole = _encode(tokenizer, context + target)
    # A context of only spaces encodes to nothing (the harness asserts); end-of-text stands in for it.
    return context_ids or [tokenizer.eot_token], whole[len(context_ids):]


def _target_logits(model, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """model(x)[rows, cols], projecting only those positions onto the vocabulary when the model allows."""
    if hasattr(model, "hidden") and hasattr(model, "logits"):  # a GPT: forward = logits(hidden(x))
        return model.logits(model.hidden(x)[rows, cols])
    return model(x)[rows, cols]


@torch.no_grad()
def score_lambada(model, tokenizer, texts: Sequence[str], batch_size: int = 16, device="cpu",
                  dtype: torch.dtype = torch.float32, progress: bool = False) -> dict:
    """Zero-shot LAMBADA: {"n", "acc", "ppl", "tokens", "seconds", "loglikelihoods", "greedy"} (lists in
    the order of `texts`). `tokenizer` needs encode(text, allowed_special=...) and eot_token (tiktoken's)."""
    device, window, vocab = torch.device(device), model.config.block_size, model.config.vocab_size
    examples = []  # (model input, target tokens)
    for i, text in enumerate(texts):
        context, target = encode_example(tokenizer, text)
        if not 0 < len(target) <= window:
            raise UserError(f"example {i}: its target is {len(target)} tokens; "
                            f"the model's window is {window}")
        if max(context + target) >= vocab:
            raise UserError(f"example {i} has token ids beyond the model's vocabulary ({vocab}); "
                            "was the checkpoint trained with another tokenizer?")
        examples.append(((context + target)[-(window + 1):][:-1], target))
    if not examples:
        raise UserError("no LAMBADA examples to score")
    # longest first, like the harness
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))
    lls, greedy = [0.0] * len(examples), [False] * len(examples)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(examples), desc="lambada", unit="ex", disable=not progress, file=sys.stderr)
    start, tokens = time.time(), 0
    for b0 in range(0, len(order), batch_size):
        batch = order[b0:b0 + batch_size]
        x = torch.zeros(len(batch), len(examples[batch[0]][0]), dtype=torch.long)  # pad id 0, on the right
        rows, cols, targets = [], [], []
        for r, i in enumerate(batch):
            inp, target = examples[i]
            x[r, :len(inp)] = torch.tensor(inp)
            rows += [r] * len(target)
            cols += range(len(inp) - len(target), len(inp))  # positions that predict the target tokens
            targets += target
            tokens += len(inp)
        with autocast_context(device, dtype):
            logits = _target_logits(model, x.to(device), torch.tensor(rows, device=device),
                                    torch.tensor(cols, device=device))
        logp = F.log_softmax(logits.float(), dim=-1)
        y = torch.tensor(targets, device=device)
        token_lp = logp.gather(1, y[:, None]).squeeze(1).double().cpu()
        hit = (logp.argmax(dim=-1) == y).cpu()
        k = 0
        for i in batch:
            m = len(examples[i][1])
            lls[i], greedy[i] = token_lp[k:k + m].sum().item(), bool(hit[k:k + m].all())
            k += m
        bar.update(len(batch))
    bar.close()
    model.train(was_training)
    n = len(examples)
    return {"n": n, "acc": sum(greedy) / n, "ppl": math.exp(min(-sum(lls) / n, 700.0)), "tokens": tokens,
            "seconds": time.time() - start, "loglikelihoods": lls, "greedy": greedy}


def read_jsonl(path: str) -> list[str]:
    """The `text` of each line of a LAMBADA .jsonl file (lambada_test.jsonl's format), through results.jsonl_rows."""
    if not Path(path).is_file():
        raise UserError(f"--data={path} not found; "
                        f"pass a .jsonl file with one {{\"text\": ...}} object per line")
    texts = []
    for number, row in jsonl_rows(path, "LAMBADA file", 'pass a .jsonl file with one {"text": ...} per line'):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UserError(f"{path} line {number} has no \"text\" field; "
                            f"expected {{\"text\": \"...\"}}")
        if not row["text"].strip():
            raise UserError(f"{path} line {number} has an empty \"text\"")
        texts.append(row["text"])
    if not texts:
        raise UserError(f"{path} holds no examples; expected one {{\"text\": ...}} object per line")
    return texts


def check_hub() -> None:
    """Offline, one line at once (common.check_hub), where the datasets library would retry for most of a minute."""
    common_check_hub(LAMBADA_HUB[0], "pass --data=FILE.jsonl (one {\"text\": ...} per line, e.g. the harness's "
                     "lambada_test.jsonl)")


def load_lambada(data: str | None) -> list[str]:
    """The texts of a local .jsonl file, else of the harness's dataset on the Hugging Face hub."""
    if data:
        return read_jsonl(data)
    name, config, split = LAMBADA_HUB
    check_hub()
    try:
        import datasets  # slow to import; only needed here
        return list(datasets.load_dataset(name, config, split=split)["text"])
    except Exception as e:
        raise UserError(f"could not load {name} ({first_line(e)}); offline? pass --data=FILE.jsonl "
                        "(one {\"text\": ...} per line, e.g. the harness's lambada_test.jsonl)") from None


# ---------------------------------------------------------------------------------------------- Command line


def run_lambada(cfg: EvalConfig, model, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> dict:
    tokenizer = dataset_tokenizer(ckpt)
    texts = load_lambada(cfg.data)[:cfg.max_examples]
    r = score_lambada(model, tokenizer, texts, cfg.batch_size, device, dtype, progress=True)
    check_finite({"acc": r["acc"], "ppl": r["ppl"]}, f"lambada_openai of {cfg.ckpt}")
    print(f"lambada_openai: acc {r['acc']:.4f} | ppl {format_metric(r['ppl'], 2)} | n {r['n']} | "
          f"{r['n'] / r['seconds']:.1f} examples/s | {r['tokens'] / r['seconds']:,.0f} tokens/s")
    return {"task": "lambada", "n": r["n"], "acc": r["acc"], "ppl": r["ppl"],
            "data": cfg.data or "hf:" + "/".join(LAMBADA_HUB), "examples_per_s": r["n"] / r["seconds"],
            "tokens_per_s": r["tokens"] / r["seconds"], "seconds": r["seconds"]}


def run_val(cfg: EvalConfig, model, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> dict:
    """Validation metrics as train.py computes them, on the checkpoint's dataset (or --dataset), looked up
    under this command's --data_root: a checkpoint never decides where data is read or written."""
    train_cfg = ckpt.train_config
    dataset = val_dataset(cfg, ckpt)
    data_dir = ensure_dataset(dataset, cfg.data_root)
    meta = load_meta(data_dir)
    theirs = ckpt.data_meta
    if theirs.get("tokenizer") and not same_tokenizer(theirs, meta):
        raise UserError(f"{cfg.ckpt} was trained with tokenizer {theirs['tokenizer']!r} but {dataset} uses "
                        f"{meta['tokenizer']!r} (other ids); pass a --dataset prepared with the checkpoint's tokenizer")
    tokens = open_split(data_dir, cfg.split, model.config.vocab_size)
    block_size = train_cfg.get("block_size") or model.config.block_size
    objective = objective_of(ckpt, model, cfg.ckpt)  # its loss settings and learned pieces, an encoder's masking
    start = time.time()
    byte_counts = None  # only val.bin comes with the bytes each token stands for
    if cfg.split == "val" and not objective.mask:
        byte_counts = open_val_split(data_dir, model.config.vocab_size).byte_counts
    try:
        metrics = evaluate(objective, ValSplit(tokens, byte_counts, special_ids(meta)),
                           Validation(batch_size=cfg.batch_size, block_size=block_size, device=device, dtype=dtype,
                                      max_batches=cfg.max_batches))
    except NotFinite as e:  # loss.val_metrics' rule, said as every number eval.py would write
        check_finite({e.name: e.value}, f"{cfg.split} of {cfg.ckpt}")
        raise
    seconds = time.time() - start
    n = min((len(tokens) - 1) // block_size, (cfg.max_batches or 1 << 62) * cfg.batch_size) * block_size
    shown = " | ".join(f"{k} {format_metric(v)}" for k, v in metrics.items())
    print(f"{cfg.split} ({dataset}): {shown} | {n / seconds:,.0f} tokens/s")
    return {"task": "val", "split": cfg.split, "dataset": dataset, "n": n, "ce": metrics["val_ce"],
            "ppl": metrics["val_ppl"], **metrics, "tokens_per_s": n / seconds, "seconds": seconds}


def val_dataset(cfg: EvalConfig, ckpt: Checkpoint) -> str:
    """--task=val's dataset: --dataset, else the checkpoint's (by name: its folder is under --data_root)."""
    dataset = cfg.dataset or ckpt.train_config.get("dataset")
    if not dataset:
        raise UserError(f"{cfg.ckpt} does not record its dataset; pass --dataset=NAME (a prepared dataset)")
    if "," in dataset:  # a mixed run: its sources are scored one at a time
        raise UserError(f"{cfg.ckpt} was trained on a mix ({dataset}); pass --dataset=NAME for one of its sources")
    return dataset if cfg.dataset else recorded_dataset(dataset, cfg.data_root, cfg.ckpt)


def with_batch_size(cfg: EvalConfig, ckpt: Checkpoint) -> EvalConfig:
    """The default batch: 16 LAMBADA examples; for val, the checkpoint's training micro-batch, because the
    contrastive metrics take their negatives from the batch (and train.py's log used that one)."""
    if cfg.batch_size is not None:
        return cfg
    trained = ckpt.train_config.get("batch_size")
    return dataclasses.replace(cfg, batch_size=trained if cfg.task == "val" and trained else LAMBADA_BATCH)


def check_config(cfg: EvalConfig) -> None:
    """Counts within bounds, and no setting of the other task (it would change nothing)."""
    within_ranges(cfg)
    lambada_only = ("data", "max_examples")
    val_only = ("split", "dataset", "data_root", "max_batches")
    refuse_idle(cfg, dict.fromkeys(val_only if cfg.task == "lambada" else lambada_only,
                                   f"with --task={cfg.task} (it is a setting of the other task)"))


def main(argv: list[str]) -> dict:
    cfg = parse_flags(EvalConfig, argv)
    io = declare_io(reads={"--ckpt": cfg.ckpt, "--data": cfg.data, "--config": config_path(argv),
                           "--dataset": cfg.dataset and dataset_dir(cfg.dataset, cfg.data_root)},
                    writes={"--json": cfg.json})
    check_config(cfg)
    if cfg.task == "lambada" and not cfg.data:
        check_hub()  # before the checkpoint is read: offline, the answer comes at once
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    ckpt = load_source(cfg.ckpt, TrainConfig)
    if cfg.task == "val":  # the dataset a checkpoint names is an input too, before it is opened
        io.also_reads("--dataset", dataset_dir(val_dataset(cfg, ckpt), cfg.data_root))
    model = checkpoint_model(ckpt, cfg.ckpt).to(device).eval()
    cfg = with_batch_size(cfg, ckpt)
    if cfg.task == "lambada":
        if not model.config.causal:
            raise UserError(f"{cfg.ckpt} is a masked-LM encoder: LAMBADA needs a causal model; use glue.py")
        result = run_lambada(cfg, model, ckpt, device, dtype)
    else:
        result = run_val(cfg, model, ckpt, device, dtype)
    result = {**result, "checkpoint": cfg.ckpt, "device": device.type,
              "dtype": str(dtype).removeprefix("torch."), "batch_size": cfg.batch_size}
    if cfg.json:
        write_json(cfg.json, result)
    return result


if __name__ == "__main__":
    run_main(main)

"""Turn a headless model into a generator: add an LM head and train it briefly with cross-entropy.

    python finetune.py --ckpt=out/ckpt.pt               # ~2% of the pre-training tokens, into out-ft/

The head is an untied Linear(d, V) initialised as a copy of the input embeddings, so fine-tuning starts
exactly from the raw model's tied scores; the whole model trains (--freeze_body: the head alone). This is
train.py's loop with other defaults: every train.py flag works, data, shape, batch and device come from
the checkpoint's run, and the learning rate from the preset's recipe (FINETUNE_RECIPES).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from common import (
    DeviceName,
    DtypeName,
    UserError,
    all_reduce_sum,
    checkpoint_model,
    in_range,
    init_distributed,
    load_checkpoint,
    note,
    parse_flags,
    pick_device,
    run_main,
    world_size,
)
from loss import LossName
from model import GPT, PRESETS, PresetName, build_model, padded_vocab_size
from train import DEFAULT_RECIPE, RECIPES, TrainConfig, lr_at, train

# By preset: learning rate, schedule, warmup and final lr as shares of the steps and of lr. The Pythia
# shapes follow the official fine-tune config, which settles what the paper leaves open (1e-4 in its text,
# 1e-5 in a table): 1e-4, 1430 warmup steps of 10,000, cosine to 0. The small presets' short CPU runs take
# the paper's text (constant after a 20% warmup) with a larger rate. Other shapes get the official config.
FINETUNE_RECIPES = {
    "tiny": dict(lr=3e-4, lr_schedule="constant", warmup=0.2, final_lr=0.1),
    "pythia-70m": dict(lr=1e-4, lr_schedule="cosine", warmup=0.143, final_lr=0.0),
    "pythia-160m": dict(lr=1e-4, lr_schedule="cosine", warmup=0.143, final_lr=0.0),
    "gpt2-124m": dict(lr=3e-5, lr_schedule="constant", warmup=0.2, final_lr=0.1),
}


@dataclass
class FinetuneConfig(TrainConfig):
    ckpt: str = ""  # the pre-trained checkpoint (required), or hf:ORG/NAME
    budget_fraction: float = 0.02  # of the checkpoint's pre-training tokens
    tokens: int | None = None  # an explicit token budget instead
    max_iters: int | None = None  # or an explicit number of steps
    loss: LossName = "ce"
    lr: float | None = None  # None: the preset's recipe
    min_lr: float | None = None
    lr_schedule: Literal["cosine", "constant"] | None = None
    warmup_iters: int | None = None
    eval_interval: int = 50
    out_dir: str = "out-ft"
    dataset: str | None = None  # None: the pre-training run's own setting
    preset: PresetName | None = None
    batch_size: int | None = None
    grad_accum: int | None = None
    eval_batches: int | None = None
    device: DeviceName | None = None
    dtype: DtypeName | None = None
    compile: bool | None = None


# Where to read and write data comes from the command line (--data_root), never from the checkpoint.
INHERITED = ("dataset", "preset", "block_size", "batch_size", "grad_accum", "eval_batches", "device", "dtype",
             "compile")


# Where a run's weights come from: fresh, its own checkpoint (--resume), or another's (--init_from, which a
# fine-tune is). train.py calls starting_point; its home is here, with the other starts from a checkpoint.


@dataclass
class State:
    """What the loop counts. It travels in the checkpoint, so a resumed run goes on exactly."""
    step: int = 0
    micro_batches: int = 0  # consumed by all ranks: the position in the data stream, whatever the split
    tokens: int = 0  # tokens and FLOPs of this run, summed as they are spent
    flops: float = 0.0
    earlier_tokens: int = 0  # ... and of the checkpoints it started from (the pre-training of a fine-tune)
    earlier_flops: float = 0.0
    loss: float | None = None
    first_val: dict | None = None
    val: dict | None = None


# What makes a resumed run the same experiment; anything else may change (--max_iters extends it).
RESUME_SAME = ("objective", "loss", "dataset", "batch_size", "block_size", "negatives", "negatives_scope",
               "init_from", "untied_head")


def starting_point(cfg: TrainConfig, meta: dict, ckpt_path: Path,
                   device: torch.device) -> tuple[TrainConfig, GPT, dict | None, State]:
    """(the settings, unset ones filled in; the model; the checkpoint resumed, if any; the state)."""
    found = ckpt_path.is_file()
    if all_reduce_sum(torch.tensor([float(found)], device=device)).item() not in (0, world_size()):
        raise UserError(f"{ckpt_path} is seen by some ranks and not others: --out_dir must be on a filesystem "
                        "every node shares")
    resuming = found if cfg.resume == "auto" else cfg.resume
    if resuming and not ckpt_path.is_file():
        raise UserError(f"--resume: {ckpt_path} not found; pass the run's --out_dir, or start without --resume")
    source = ckpt_path if resuming else cfg.init_from
    start = load_checkpoint(source) if source else None
    before = start.get("train_config", {}) if start else {}
    if start:
        check_continuation(cfg, meta, start, source, resuming)
    cfg = dataclasses.replace(cfg, preset=cfg.preset or (before.get("preset") if start else "tiny"))
    if resuming:  # a resumed run keeps its own schedule
        cfg = dataclasses.replace(cfg, **{k: before.get(k) for k in ("warmup_iters", "min_lr")
                                          if getattr(cfg, k) is None})
    recipe = RECIPES.get(cfg.preset, DEFAULT_RECIPE)
    cfg = dataclasses.replace(cfg, min_lr=recipe["final_lr"] * cfg.lr if cfg.min_lr is None else cfg.min_lr,
                              warmup_iters=max(1, round(recipe["warmup"] * cfg.max_iters))
                              if cfg.warmup_iters is None else cfg.warmup_iters)
    if not start:  # a fresh model; an encoder gets room for the [MASK] id past the tokenizer's ids
        mlm = cfg.objective == "mlm"
        return cfg, build_model(cfg.preset, padded_vocab_size(meta["vocab_size"] + mlm), dropout=cfg.dropout,
                                block_size=cfg.block_size or PRESETS[cfg.preset]["block_size"], causal=not mlm,
                                lm_head=cfg.loss == "nce" or cfg.untied_head), None, State()
    model = checkpoint_model(start, source, dropout=cfg.dropout)
    if resuming:
        old = before.get("max_iters", cfg.max_iters)
        if old != cfg.max_iters and cfg.lr_schedule == "cosine":
            note(f"note: --max_iters changed from {old} to {cfg.max_iters} on resume: the cosine schedule now decays "
                 f"over {cfg.max_iters} steps (lr at step {start['step']}: {lr_at(start['step'], cfg):.2e}, was "
                 f"{lr_at(start['step'], dataclasses.replace(cfg, max_iters=old)):.2e})")
        if "state" in start:
            return cfg, model, start, State(**start["state"])
        per_micro = before["batch_size"] * (before.get("block_size") or model.config.block_size)
        return cfg, model, start, State(  # written before the data position was counted: derived
            step=start["step"], micro_batches=start["tokens_seen"] // per_micro, tokens=start["tokens_seen"],
            flops=start["flops"], earlier_tokens=start["base_tokens"], earlier_flops=start["base_flops"],
            first_val=start.get("first_val"), val=start.get("val"))
    if cfg.add_lm_head or (cfg.untied_head and model.lm_head is None):
        model.add_lm_head()  # a head made from E
    elif cfg.loss == "cwt" and model.lm_head is not None:  # nothing would train it: it would go stale
        model.drop_lm_head()
        note(f"note: {source} has an untied LM head, but --loss=cwt trains a headless model: the head is dropped "
             "(finetune.py adds a fresh one)")
    if cfg.loss == "nce" and model.lm_head is None:
        raise UserError("--loss=nce needs a separate output table; start it fresh, not from a tied checkpoint")
    return cfg, model, None, State(earlier_tokens=start.get("base_tokens", 0) + start.get("tokens_seen", 0),
                                   earlier_flops=start.get("base_flops", 0.0) + start.get("flops", 0.0))


def check_continuation(cfg: TrainConfig, meta: dict, start: dict, source: str | Path, resuming: bool) -> None:
    """A checkpoint continues on data of its own tokenizer, as the same kind and shape of model; a resumed
    one as the same experiment (with --resume=auto, other settings mean another experiment's out_dir)."""
    before, encoder = start.get("train_config", {}), not start["model_config"].get("causal", True)
    for key in RESUME_SAME if resuming else ():
        if key in before and before[key] != getattr(cfg, key):
            raise UserError(f"--{key}={getattr(cfg, key)} but {source} was trained with --{key}={before[key]}; "
                            f"resume with the same --{key}, or use another --out_dir for another experiment")
    if resuming and cfg.max_iters < start["step"]:
        raise UserError(f"--max_iters={cfg.max_iters} is below the step {start['step']} of {source}")
    theirs = start.get("data_meta", {})  # tokenizers compare by their tokenizer.json's sha256, else by name
    if theirs.get("tokenizer") and (theirs.get("tokenizer_sha256") or theirs["tokenizer"]) != \
            (meta.get("tokenizer_sha256") or meta["tokenizer"]):
        raise UserError(f"{source} was trained with tokenizer {theirs['tokenizer']!r} but the dataset uses "
                        f"{meta['tokenizer']!r} (another vocabulary); prepare the data with the same --tokenizer")
    if encoder != (cfg.objective == "mlm"):
        raise UserError(f"{source} is {'a masked-LM encoder' if encoder else 'a causal decoder'} but this run's "
                        f"--objective is {cfg.objective}; " + ("continue it with --objective=mlm, or fine-tune it "
                        "with glue.py" if encoder else "--objective=mlm starts fresh or from an encoder"))
    if cfg.preset not in (None, before.get("preset")) and before.get("preset"):
        raise UserError(f"--preset={cfg.preset} but {source} holds a {before['preset']} model; "
                        f"{'resume' if resuming else 'start from it'} with --preset={before['preset']} or without")
    if (cfg.block_size or 0) > start["model_config"]["block_size"]:
        raise UserError(f"--block_size={cfg.block_size} exceeds the {start['model_config']['block_size']} "
                        f"tokens of context of {source}")


def finetune_recipe(preset: str | None) -> dict:
    return FINETUNE_RECIPES.get(preset, FINETUNE_RECIPES["pythia-70m"])


def finetune_budget(pretrain_tokens: int, tokens_per_iter: int, fraction: float = 0.02,
                    tokens: int | None = None, max_iters: int | None = None) -> int:
    """Steps to run: max_iters, else the token budget over the tokens of a step, rounded up."""
    if max_iters is not None:
        return max_iters
    return max(1, math.ceil((tokens if tokens is not None else fraction * pretrain_tokens) / tokens_per_iter))


def resolve_config(argv: list[str]) -> FinetuneConfig:
    cfg = parse_flags(FinetuneConfig, argv)
    return inherit_settings(cfg, base_checkpoint(cfg))


def base_checkpoint(cfg: FinetuneConfig) -> dict:
    if not cfg.ckpt:
        raise UserError("missing --ckpt=PATH: the pre-trained checkpoint to fine-tune (e.g. out/ckpt.pt)")
    return load_checkpoint(cfg.ckpt)


def inherit_settings(cfg: FinetuneConfig, base: dict) -> FinetuneConfig:
    """The unset settings (None) from the pre-training run, then the preset's recipe, then the checks."""
    if cfg.loss != "ce":
        raise UserError(f"finetune.py trains the LM head with cross-entropy; --loss={cfg.loss} is for train.py")
    if not base["model_config"].get("causal", True):
        raise UserError(f"{cfg.ckpt} is a masked-LM encoder; finetune.py gives decoders an LM head: fine-tune "
                        "encoders on a task with glue.py")
    before, defaults = base.get("train_config", {}), TrainConfig()
    cfg = dataclasses.replace(cfg, **{k: before.get(k, getattr(defaults, k)) for k in INHERITED
                                      if getattr(cfg, k) is None})
    recipe = finetune_recipe(cfg.preset)
    lr = recipe["lr"] if cfg.lr is None else cfg.lr
    cfg = dataclasses.replace(cfg, lr=lr, lr_schedule=cfg.lr_schedule or recipe["lr_schedule"],
                              min_lr=recipe["final_lr"] * lr if cfg.min_lr is None else cfg.min_lr)
    in_range(cfg, "budget_fraction", 0, 1, "(]")
    for name in ("tokens", "batch_size", "grad_accum"):
        in_range(cfg, name, 1)
    return cfg


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune cfg.ckpt with an LM head; returns train()'s summary plus the budget figures."""
    base = base_checkpoint(cfg)
    cfg = inherit_settings(cfg, base)
    pretrain_tokens = base.get("base_tokens", 0) + base.get("tokens_seen", 0)
    pretrain_flops = base.get("base_flops", 0.0) + base.get("flops", 0.0)
    if not pretrain_tokens and cfg.tokens is None and cfg.max_iters is None:
        raise UserError(f"{cfg.ckpt} records no pre-training tokens (an imported model), so 2% of them is "
                        "unknown: pass --tokens=N or --max_iters=N (Pythia: 2% of 300B is --tokens=6e9)")
    init_distributed(pick_device(cfg.device))  # under torchrun a step takes every rank's micro-batches
    block = cfg.block_size or base["model_config"]["block_size"]
    tokens_per_iter = cfg.batch_size * block * cfg.grad_accum * world_size()
    steps = finetune_budget(pretrain_tokens, tokens_per_iter, cfg.budget_fraction, cfg.tokens, cfg.max_iters)
    warmup = cfg.warmup_iters if cfg.warmup_iters is not None else \
        max(1, round(finetune_recipe(cfg.preset)["warmup"] * steps))
    share = f"{100 * steps * tokens_per_iter / pretrain_tokens:.2f}% of {pretrain_tokens:,} pre-training tokens" \
        if pretrain_tokens else "pre-training tokens unknown"
    note(f"fine-tune budget: {steps} steps x {tokens_per_iter:,} tokens = {steps * tokens_per_iter:,} tokens ({share})")
    summary = train(dataclasses.replace(cfg, max_iters=steps, warmup_iters=warmup, init_from=cfg.ckpt,
                                        add_lm_head=True))
    spent = summary["flops"] - pretrain_flops
    summary.update(pretrain_tokens=pretrain_tokens, pretrain_flops=pretrain_flops, finetune_flops=spent,
                   compute_fraction=spent / pretrain_flops if pretrain_flops else float("nan"))
    if summary["first_val"] and summary["val"]:
        compute = f" | compute: {100 * summary['compute_fraction']:.2f}% of pre-training" if pretrain_flops else ""
        note(f"validation CE: {summary['first_val']['val_ce']:.4f} before -> {summary['val']['val_ce']:.4f} after "
             f"fine-tuning{compute}")
    return summary


def main(argv: list[str]) -> None:
    finetune(parse_flags(FinetuneConfig, argv))


if __name__ == "__main__":
    run_main(main)

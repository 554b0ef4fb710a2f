"""Turn a headless model into a generator: add an LM head and train it briefly with cross-entropy.

    python finetune.py --ckpt=out/ckpt.pt               # ~2% of the pre-training tokens, into out-ft/

The new head is an untied `Linear(d, V)` initialised as a copy of the input embeddings, so fine-tuning
starts exactly from the raw model's tied scores. Cross-entropy, gradient clipping 1.0, the whole model
trainable (`--freeze_body` trains the head alone), and the preset's learning-rate recipe
(FINETUNE_RECIPES: the official config's for the Pythia shapes). This is train.py's loop with other defaults;
every train.py flag works here too, and `--resume` continues an interrupted fine-tune.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from common import (DeviceName, DtypeName, UserError, check_ranges, init_distributed, load_checkpoint,
                    parse_flags, pick_device, run_main, world_size)
from loss import LossName
from model import PresetName
from train import TRAIN_RANGES, TrainConfig, note, train

# Head fine-tune recipe by preset: learning rate, schedule, warmup (share of the steps), final lr (share
# of lr). The Pythia shapes follow the official fine-tune config, which settles what the paper leaves
# open (1e-4 in its text, 1e-5 in a table): 1e-4, 1430 warmup steps of 10,000, cosine to 0. The paper's
# text (constant lr after a 20% warmup) with a larger rate suits the small presets' short CPU runs.
FINETUNE_RECIPES = {
    "tiny": dict(lr=3e-4, lr_schedule="constant", warmup=0.2, final_lr=0.1),
    "pythia-70m": dict(lr=1e-4, lr_schedule="cosine", warmup=0.143, final_lr=0.0),
    "pythia-160m": dict(lr=1e-4, lr_schedule="cosine", warmup=0.143, final_lr=0.0),
    "gpt2-124m": dict(lr=3e-5, lr_schedule="constant", warmup=0.2, final_lr=0.1),
}


@dataclass
class FinetuneConfig(TrainConfig):
    ckpt: str = ""  # the pre-trained checkpoint to start from (required)
    budget_fraction: float = 0.02  # of the checkpoint's pre-training tokens
    tokens: int | None = None  # an explicit token budget instead
    max_iters: int | None = None  # or an explicit number of steps
    loss: LossName = "ce"
    # None: the preset's FINETUNE_RECIPES entry
    lr: float | None = None
    min_lr: float | None = None
    lr_schedule: Literal["cosine", "constant"] | None = None
    warmup_iters: int | None = None
    eval_interval: int = 50
    out_dir: str = "out-ft"
    # None: the pre-training run's own setting (same data, shape, batch and system)
    dataset: str | None = None
    data_root: str | None = None
    preset: PresetName | None = None
    batch_size: int | None = None
    grad_accum: int | None = None
    eval_batches: int | None = None
    device: DeviceName | None = None
    dtype: DtypeName | None = None
    compile: bool | None = None


FINETUNE_RANGES = {**TRAIN_RANGES, "budget_fraction": "(0, 1]", "tokens": "[1, inf)"}
INHERITED = ("dataset", "data_root", "preset", "block_size", "batch_size", "grad_accum", "eval_batches",
             "device", "dtype", "compile")


def finetune_recipe(preset: str | None) -> dict:
    """The preset's fine-tune recipe; a shape without one (a Hugging Face model of another size, a causal
    bert-* shape) gets the official config's."""
    return FINETUNE_RECIPES.get(preset, FINETUNE_RECIPES["pythia-70m"])


def finetune_budget(pretrain_tokens: int, tokens_per_iter: int, fraction: float = 0.02,
                    tokens: int | None = None, max_iters: int | None = None) -> int:
    """Steps to run: explicit max_iters, else ceil(token budget / tokens per step), at least one."""
    if max_iters is not None:
        return max_iters
    budget = tokens if tokens is not None else fraction * pretrain_tokens
    return max(1, math.ceil(budget / tokens_per_iter))


def inherit_settings(cfg: FinetuneConfig, base: dict) -> FinetuneConfig:
    """Fill the settings left unset (None) from the pre-training run's config, then check them."""
    if cfg.loss != "ce":
        raise UserError("finetune.py trains the LM head with cross-entropy; "
                        f"--loss={cfg.loss} is for train.py")
    if not base["model_config"].get("causal", True):
        raise UserError(f"{cfg.ckpt} is a masked-LM encoder; finetune.py gives decoders an LM head: "
                        "fine-tune encoders on a task with glue.py")
    base_cfg, defaults = base.get("train_config", {}), TrainConfig()
    filled = {k: base_cfg.get(k, getattr(defaults, k)) for k in INHERITED if getattr(cfg, k) is None}
    cfg = dataclasses.replace(cfg, **filled)
    recipe = finetune_recipe(cfg.preset)
    lr = cfg.lr if cfg.lr is not None else recipe["lr"]
    cfg = dataclasses.replace(cfg, lr=lr, lr_schedule=cfg.lr_schedule or recipe["lr_schedule"],
                              min_lr=cfg.min_lr if cfg.min_lr is not None else recipe["final_lr"] * lr)
    check_ranges(cfg, FINETUNE_RANGES)  # before the budget divides by the batch
    return cfg


def base_checkpoint(cfg: FinetuneConfig) -> dict:
    if not cfg.ckpt:
        raise UserError("missing --ckpt=PATH: the pre-trained checkpoint to fine-tune (e.g. out/ckpt.pt)")
    return load_checkpoint(cfg.ckpt)


def resolve_config(argv: list[str]) -> FinetuneConfig:
    """The complete settings of a command line, unset ones taken from the checkpoint's run."""
    cfg = parse_flags(FinetuneConfig, argv)
    return inherit_settings(cfg, base_checkpoint(cfg))


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune `cfg.ckpt` with an LM head; returns train()'s summary plus the budget figures."""
    base = base_checkpoint(cfg)
    cfg = inherit_settings(cfg, base)
    pretrain_tokens = base.get("base_tokens", 0) + base.get("tokens_seen", 0)
    pretrain_flops = base.get("base_flops", 0.0) + base.get("flops", 0.0)
    block = cfg.block_size or base["model_config"]["block_size"]
    init_distributed(pick_device(cfg.device))  # under torchrun a step takes every rank's micro-batches
    tokens_per_iter = cfg.batch_size * block * cfg.grad_accum * world_size()
    steps = finetune_budget(pretrain_tokens, tokens_per_iter, cfg.budget_fraction, cfg.tokens, cfg.max_iters)
    warmup = cfg.warmup_iters
    if warmup is None:
        warmup = max(1, round(finetune_recipe(cfg.preset)["warmup"] * steps))
    run_cfg = dataclasses.replace(cfg, max_iters=steps, warmup_iters=warmup, init_from=cfg.ckpt,
                                  add_lm_head=True)
    note(f"fine-tune budget: {steps} steps x {tokens_per_iter:,} tokens = {steps * tokens_per_iter:,} tokens "
         f"({100 * steps * tokens_per_iter / max(pretrain_tokens, 1):.2f}% of {pretrain_tokens:,} "
         "pre-training tokens)")
    summary = train(run_cfg)
    spent = summary["flops"] - pretrain_flops
    summary.update(pretrain_tokens=pretrain_tokens, pretrain_flops=pretrain_flops, finetune_flops=spent,
                   compute_fraction=spent / pretrain_flops if pretrain_flops else float("nan"))
    before, after = summary["first_val"], summary["val"]
    if before and after:
        note(f"validation CE: {before['val_ce']:.4f} before -> {after['val_ce']:.4f} after fine-tuning | "
             f"compute: {100 * summary['compute_fraction']:.2f}% of pre-training")
    return summary


def main(argv: list[str]) -> None:
    finetune(parse_flags(FinetuneConfig, argv))


if __name__ == "__main__":
    run_main(main)

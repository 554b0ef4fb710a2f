"""Turn a headless model into a generator: add an LM head and train it briefly with cross-entropy.

    python finetune.py --ckpt=out/ckpt.safetensors    # ~2% of the pre-training tokens, into out-ft/

The head is an untied Linear(d, V), a copy of the input embeddings: fine-tuning starts from the raw model's
tied scores; the whole model trains (--freeze_body: the head alone). It is train.py's loop: every flag works,
data, shape, batch and device come from the checkpoint's run, the learning rate from FINETUNE_RECIPES."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import cli
import ddp
import devices
import doors
import plan
import run_folder
from checkpoint import Checkpoint
from common import UserError, note
from data import recorded_dataset
from load import source_document
from loss import LossName
from train import SAME, TrainConfig, train

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
    """finetune.py's settings: train.py's, some with other defaults (a field redeclared keeps its rule). Those of
    INHERITED that are not given are the pre-training run's, whatever their default."""
    ckpt: str = field(default="", metadata={**SAME, "help": "the pre-trained checkpoint (required), or hf:ORG/NAME"})
    budget_fraction: float = field(default=0.02, metadata={
        "range": (0, 1, "(]"), "help": "the budget: this share of the checkpoint's pre-training tokens"})
    tokens: int | None = field(default=None, metadata={"range": (1, 1 << 50),
                                                       "help": "the budget in tokens instead"})
    max_iters: int | None = field(default=None, metadata={"help": "the budget in optimizer steps instead"})
    loss: LossName = field(default="ce", metadata={"help": "ce: finetune.py trains the LM head with cross-entropy"})
    lr: float | None = field(default=None, metadata={"help": "peak learning rate; none: the preset's recipe"})
    lr_schedule: Literal["cosine", "constant"] | None = field(default=None, metadata={
        "help": "after the warmup: cosine decay to min_lr, or constant; none: the preset's recipe"})
    eval_interval: int = 50
    out_dir: str = "out-ft"


# What a fine-tune takes from the pre-training run unless given: its data stream (read on where it stopped), shape,
# batch and machine. Where to read and write data comes from the command line (--data_root), never the checkpoint.
INHERITED = ("dataset", "mix_alpha", "preset", "block_size", "batch_size", "grad_accum", "eval_batches", "device",
             "dtype", "compile", "seed")


def finetune_budget(pretrain_tokens: int, tokens_per_iter: int, fraction: float = 0.02,
                    tokens: int | None = None, max_iters: int | None = None) -> int:
    """Steps to run: max_iters, else the token budget over the tokens of a step, rounded up."""
    if max_iters is not None:
        return max_iters
    return max(1, math.ceil((tokens if tokens is not None else fraction * pretrain_tokens) / tokens_per_iter))


def resolve_config(argv: list[str]) -> FinetuneConfig:
    return settle(*cli.parse_given(FinetuneConfig, argv))[0]


def settle(cfg: FinetuneConfig, given: frozenset[str],
           idle: Callable | None = None) -> tuple[FinetuneConfig, frozenset[str], Checkpoint]:
    """finetune.py's plan (plan.settle's, for what a fine-tune decides): the settings, the names now given, and the
    checkpoint document the budget counts from, `idle` (the script's idle_settings) refused among those given. A
    resumed fine-tune is its own run (plan.resumed): the settings not given are its own (its --ckpt, budget, steps,
    warmup and lr) and count as given from then on (nothing is inherited or recomputed); its document holds all it
    needs (its --ckpt is a record, never opened). A new one reads the pre-training run's document."""
    cfg, own = plan.resumed(cfg, given)
    if idle:
        cli.refuse_idle(cfg, {k: why for k, why in idle(cfg).items() if k in given})
    if own is not None:
        settled = given | {k for k in own.train_config if doors.field_meta(type(cfg), k).get("resume") != "here"}
        return inherit_settings(cfg, own, settled), settled, own
    if not cfg.ckpt:
        raise UserError("missing --ckpt=PATH: the pre-trained checkpoint to fine-tune (e.g. out/ckpt.safetensors)")
    base = source_document(cfg.ckpt, TrainConfig)  # its settings and counts; its weights are read by the run
    return inherit_settings(cfg, base, given), given, base


def inherit_settings(cfg: FinetuneConfig, base: Checkpoint, given: Iterable[str] | None = None) -> FinetuneConfig:
    """The settings of INHERITED not given from the pre-training run, then the preset's recipe for those still
    unset (None), then the checks that need the checkpoint."""
    given = cli.given_settings(cfg, given)
    if cfg.loss != "ce":
        raise UserError(f"finetune.py trains the LM head with cross-entropy; --loss={cfg.loss} is for train.py")
    if not base.model_config.causal:
        raise UserError(f"{cfg.ckpt} is a masked-LM encoder; finetune.py gives decoders an LM head: fine-tune "
                        "encoders on a task with glue.py")
    before = base.train_config
    defaults = TrainConfig()
    inherited = {k: before.get(k, getattr(defaults, k)) for k in INHERITED if k not in given}
    if inherited.get("dataset"):  # looked up under --data_root, never opened as written
        inherited["dataset"] = ",".join(recorded_dataset(name, cfg.data_root, cfg.ckpt)
                                        for name in inherited["dataset"].split(","))
    cfg = dataclasses.replace(cfg, **inherited)
    recipe = FINETUNE_RECIPES.get(cfg.preset, FINETUNE_RECIPES["pythia-70m"])
    lr = recipe["lr"] if cfg.lr is None else cfg.lr
    cfg = dataclasses.replace(cfg, lr=lr, lr_schedule=cfg.lr_schedule or recipe["lr_schedule"],
                              min_lr=recipe["final_lr"] * lr if cfg.min_lr is None else cfg.min_lr)
    cli.in_range(cfg, "block_size", 2, base.model_config.block_size)  # before any data
    block = cfg.block_size or base.model_config.block_size
    common.through_door(doors.check_step, cfg.batch_size, cfg.grad_accum, block)
    return cfg


def finetune(cfg: FinetuneConfig, given: Iterable[str] | None = None,
             idle: Callable | None = None) -> dict[str, Any]:
    """Fine-tune cfg.ckpt with an LM head; returns train()'s summary plus the budget figures. `given` and `idle`: as
    train()'s. Its plan is settled first (settle); a resumed one reads nothing but its own folder."""
    plan.declare_paths(cfg, "--ckpt", cfg.ckpt)
    cfg, given, base = settle(cfg, cli.given_settings(cfg, given), idle)
    resuming = run_folder.resumes(cfg.out_dir, cfg.resume)
    # the checkpoint's lineage; a resumed fine-tune's base counts alone (its own tokens are not pre-training's)
    pretrain_tokens = base.state.earlier_tokens if resuming else base.pretrain_tokens()
    pretrain_flops = base.state.earlier_flops if resuming else base.pretrain_flops()
    if not pretrain_tokens and cfg.tokens is None and cfg.max_iters is None:
        raise UserError(f"{cfg.ckpt} records no pre-training tokens (an imported model), so 2% of them is "
                        "unknown: pass --tokens=N or --max_iters=N (Pythia: 2% of 300B is --tokens=6e9)")
    ddp.init_distributed(devices.pick_device(cfg.device))  # under torchrun a step takes every rank's micro-batches
    block = cfg.block_size or base.model_config.block_size
    tokens_per_iter = cfg.batch_size * block * cfg.grad_accum * ddp.world_size()
    steps = finetune_budget(pretrain_tokens, tokens_per_iter, cfg.budget_fraction, cfg.tokens, cfg.max_iters)
    most = doors.field_meta(TrainConfig, "max_iters")["range"][1]  # the bound of --max_iters, which it stands for
    if steps > most:
        budget = cfg.tokens if cfg.tokens is not None else cfg.budget_fraction * pretrain_tokens
        raise UserError(f"{budget:,.0f} tokens are {steps:,} steps of {tokens_per_iter:,} tokens, more than a run "
                        f"can have ({most:,}); lower --tokens or raise --batch_size")
    warmup_share = FINETUNE_RECIPES.get(cfg.preset, FINETUNE_RECIPES["pythia-70m"])["warmup"]
    warmup = max(1, round(warmup_share * steps)) if cfg.warmup_iters is None else cfg.warmup_iters
    share = "pre-training tokens unknown"
    if pretrain_tokens:
        share = f"{100 * steps * tokens_per_iter / pretrain_tokens:.2f}% of {pretrain_tokens:,} pre-training tokens"
    note(f"fine-tune budget: {steps} steps x {tokens_per_iter:,} tokens = {steps * tokens_per_iter:,} tokens ({share})")
    cfg = dataclasses.replace(cfg, max_iters=steps, warmup_iters=warmup, init_from=cfg.ckpt, add_lm_head=True)
    summary = train(cfg, given | {"max_iters", "warmup_iters", "init_from", "add_lm_head"})
    spent = summary["flops"] - pretrain_flops
    summary.update(pretrain_tokens=pretrain_tokens, pretrain_flops=pretrain_flops, finetune_flops=spent,
                   compute_fraction=spent / pretrain_flops if pretrain_flops else None)
    if summary["first_val"] and summary["val"] and not summary["interrupted"]:  # a stopped one is not done
        compute = f" | compute: {100 * summary['compute_fraction']:.2f}% of pre-training" if pretrain_flops else ""
        note(f"validation CE: {summary['first_val']['val_ce']:.4f} before -> {summary['val']['val_ce']:.4f} after "
             f"fine-tuning{compute}")
    return summary


def idle_settings(cfg: FinetuneConfig) -> dict[str, str]:
    """The settings a command line gives that would change nothing (refused: cli.refuse_idle)."""
    idle = {"init_from": "in finetune.py (it starts from --ckpt)",
            "add_lm_head": "in finetune.py (it always adds the LM head)",
            "quick": "in finetune.py (its shape comes from --ckpt; --max_iters=N makes it short)"}
    if cfg.max_iters is not None or cfg.tokens is not None:
        idle["budget_fraction"] = "with --max_iters or --tokens (they set the budget)"
    if cfg.max_iters is not None:
        idle["tokens"] = "with --max_iters (it sets the number of steps)"
    return {**idle, **plan.idle_anywhere(cfg)}


def main(argv: list[str]) -> None:
    cfg, given = cli.parse_given(FinetuneConfig, argv)
    summary = finetune(cfg, given, idle_settings)
    if summary["signal"] is not None:  # a planned stop (--stop_at) exits 0
        raise common.Interrupted(summary["signal"])


if __name__ == "__main__":
    common.run_main(main)

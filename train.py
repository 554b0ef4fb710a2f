"""Pre-train a language model headless, with Contrastive Weight Tying (CWT), or with cross-entropy.

    python train.py                                   # tiny model, built-in Shakespeare, CWT: CPU ok
    python train.py --loss=ce --out_dir=out-ce        # the usual vocabulary head (tied to E)
    python train.py --preset=pythia-70m --dataset=tinystories --compile     # the paper's decoder, a GPU
    torchrun --standalone --nproc_per_node=8 train.py ...                   # several GPUs

The whole training story, top to bottom: the settings (TrainConfig: --key=value flags or --config=FILE,
--help lists them); where the weights come from; the objective; validation; the run; the loop, train(),
which finetune.py and compare.py call too. Plumbing (processes, files, signals) is reached as
file.X: ddp.X, safe_files.X, common.X.
"""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import checkpoint
import cli
import ddp
import devices
import doors
import io_checks
import run_folder
from checkpoint import (
    Checkpoint,
    Init,
    Rng,
    Scaler,
    State,
    checkpoint_model,
    diverged,
    save_checkpoint,
)
from common import UserError, note
from data import (
    BatchSampler,
    ValSplit,
    check_same_data,
    dataset_dir,
    open_split,
    open_val_split,
    same_tokenizer,
    sequential_batches,
)
from devices import DeviceName, DtypeName
from load import load_source, source_document
from loss import (
    VAL_SUMS,
    LossConfig,
    NotFinite,
    contrastive_table,
    scored_columns,
    training_loss,
    val_metrics,
    validation_sums,
)
from model import GPT, PRESETS, GPTConfig, PresetName, adamw, optimizer_step, padded_vocab_size
from run_folder import append_log

# The model's settings: every GPTConfig field is a flag of the same name (a field a fork adds too), unset (None) by
# default: a fresh run takes the preset's value, a run from a checkpoint the checkpoint's (with_model). Three follow
# from other settings instead: vocab_size (the tokenizer's, padded), causal (--objective), lm_head (--loss,
# --untied_head, --add_lm_head).
DERIVED = ("vocab_size", "causal", "lm_head")
ModelSettings = cli.unset_fields(GPTConfig, DERIVED, "model settings: GPTConfig's fields (unset: the preset's "
                                    "value, or the checkpoint's)")
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSettings))
SAME = {"resume": "same"}  # a field's resume rule (doors: field metadata): another value is another experiment
HERE = {"resume": "here"}  # ... this command's, never the resumed run's: where files are, the device, --resume


@dataclass
class TrainConfig(ModelSettings, LossConfig):
    """train.py's settings; the model's (ModelSettings) and the objective's (loss.LossConfig) are inherited. Each
    field's rule is on it (doors.field_rules): its type, its "range" (the flag's, a --config file's and a
    checkpoint's train_config's), what --resume does with it ("resume": resumed_settings), and its meaning ("help":
    --help and docs/training.md's table)."""
    # data and model
    dataset: str = field(default="shakespeare", metadata={
        **SAME, "help": "a prepared dataset under --data_root, or its folder (prepare.py); A,B,C: a mix of several"})
    data_root: str = field(default="data", metadata={**HERE, "help": "where prepare.py put the datasets"})
    mix_alpha: float = field(default=0.3, metadata={
        "range": (0, 100, "(]"), "help": "with several datasets: a source is drawn with probability ~ tokens^alpha"})
    preset: PresetName | None = field(default=None, metadata={
        "help": "the model's shape (model.py); none: tiny, or the checkpoint's when starting from one"})
    # objective (the loss and its negatives: loss.LossConfig)
    objective: Literal["causal", "mlm"] = field(default="causal", metadata={
        **SAME, "help": "causal: next-token; mlm: a bidirectional encoder with BERT masking (masking.py)"})
    untied_head: bool = field(default=False, metadata={
        **SAME, "help": "with ce: a separate output matrix, as Pythia's config"})
    # optimisation
    batch_size: int = field(default=8, metadata={
        "range": (1, 1 << 16), **SAME, "help": "sequences per micro-batch and rank: CWT's negatives come from it"})
    grad_accum: int = field(default=1, metadata={"range": (1, 1 << 16),
                                                 "help": "micro-batches per optimizer step, per rank"})
    max_iters: int = field(default=600, metadata={"range": (1, 1 << 32), "help": "optimizer steps"})
    stop_at: int | None = field(default=None, metadata={**HERE, "range": (1, 1 << 32), "help": "stop at this step "
                                "as a signal would (saved, exit 0); --resume goes on to max_iters"})
    lr: float = field(default=1e-3, metadata={"range": (0, 10, "(]"),  # the paper's Pythia settings
                                              "help": "peak learning rate (AdamW)"})
    min_lr: float | None = field(default=None, metadata={
        "range": (0, math.inf), "help": "final learning rate; none: the preset's recipe (lr / 10; pythia: 0)"})
    warmup_iters: int | None = field(default=None, metadata={
        "range": (0, 1 << 32), "help": "linear warmup steps; none: the recipe's (10% of max_iters; pythia: 1%)"})
    lr_schedule: Literal["cosine", "constant"] = field(default="cosine", metadata={
        "help": "after the warmup: cosine decay to min_lr, or constant"})
    weight_decay: float = field(default=0.1, metadata={
        "range": (0, math.inf), "help": "AdamW's, on matrices and embeddings, not norms nor biases"})
    beta1: float = field(default=0.9, metadata={"range": (0, 1, "[)"), "help": "AdamW's beta1"})
    beta2: float = field(default=0.95, metadata={"range": (0, 1, "[)"), "help": "AdamW's beta2"})
    eps: float = field(default=1e-8, metadata={"range": (0, math.inf, "(]"), "help": "AdamW's epsilon"})
    grad_clip: float = field(default=1.0, metadata={"range": (0, math.inf),
                                                    "help": "clip the gradient's norm to this; 0: no clipping"})
    # validation, logs and checkpoints
    eval_interval: int = field(default=100, metadata={"range": (1, 1 << 32),
                                                      "help": "steps between validations (each saves a checkpoint)"})
    eval_batches: int = field(default=20, metadata={"range": (1, 1 << 20), "help": "micro-batches of a validation"})
    log_interval: int = field(default=10, metadata={"range": (1, 1 << 32), "help": "steps between progress lines"})
    out_dir: str = field(default="out", metadata={**HERE, "help": "the run's folder: ckpt.safetensors, log.jsonl"})
    resume: bool | Literal["auto"] = field(default=False, metadata={
        **HERE, "help": "continue the run in out_dir (a setting not given: the run's own); auto: if there is one"})
    overwrite: bool = field(default=False, metadata={
        **HERE, "help": "start over in an out_dir that holds another run (otherwise refused)"})
    tensorboard: bool = field(default=False, metadata={
        "help": "also log every log.jsonl record to out_dir/tb (tracking.py)"})
    wandb: bool = field(default=False, metadata={
        "help": "also log every record to Weights & Biases, its files under out_dir (tracking.py)"})
    wandb_project: str = field(default="headless-lm", metadata={"help": "the W&B project"})
    wandb_run_name: str = field(default="", metadata={"help": "the W&B run's name; empty: the out_dir"})
    # system
    device: DeviceName = field(default="auto", metadata={**HERE, "help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "auto: bfloat16 on CUDA (float16 without it), float32 on the CPU"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model and loss, and validation"})
    quick: bool = field(default=False, metadata={
        **HERE, "help": "the settings not given: a 30-step tiny run (QUICK), seconds on a CPU"})
    seed: int = field(default=1337, metadata={  # numpy's generators take no negative seed
        "range": (0, 2**32 - 1), **SAME, "help": "the initial weights, the batches, sampled negatives"})
    # starting from another checkpoint's weights (finetune.py sets these)
    init_from: str = field(default="", metadata={
        **SAME, "help": "start from this checkpoint's weights, or hf:ORG/NAME / hf:FOLDER (hf.py); empty: fresh"})
    add_lm_head: bool = field(default=False, metadata={
        "help": "add an untied LM head initialised from the input embeddings"})
    freeze_body: bool = field(default=False, metadata={"help": "train only the LM head"})


# The paper's schedule for the Pythia shapes: cosine to 0 after a 1% warmup (1430 of 143,000 steps); lr,
# betas, decay and clip are TrainConfig's defaults. Short CPU runs warm up over 10% and end at lr / 10.
RECIPES = {"pythia-70m": dict(warmup=0.01, final_lr=0.0), "pythia-160m": dict(warmup=0.01, final_lr=0.0)}
DEFAULT_RECIPE = dict(warmup=0.1, final_lr=0.1)


def check_config(cfg: TrainConfig) -> None:
    """Refuse settings that cannot work, or that would change nothing, before any time is spent. Each setting's
    own range is its field's (checked by the flags' door; again here for settings built in code)."""
    if why := cli.settings_problem(cfg):
        raise UserError(why)
    if not cfg.resume:  # a resumed run's lr may be its own: with_schedule
        cli.in_range(cfg, "min_lr", 0, cfg.lr)
    if "" in (cfg.out_dir, cfg.data_root, *cfg.dataset.split(",")):  # an empty path is the current folder
        raise UserError("--out_dir, --data_root and each name of --dataset must be given (not empty)")
    io_checks.check_path_names({"--data_root": [cfg.data_root]})  # named as given, before the dataset paths it prefixes
    check_objective(cfg)
    if "," in cfg.dataset:
        common.need_extra("mixing", "--dataset=A,B,...")
    if cfg.tensorboard or cfg.wandb:
        common.need_extra("tracking", "--tensorboard and --wandb")
        from tracking import check_tracking
        check_tracking(cfg)
    if cfg.untied_head and cfg.loss not in ("ce", "ce+cwt"):
        raise UserError(f"--untied_head gives cross-entropy its own output matrix; --loss={cfg.loss} has none")
    if cfg.freeze_body and not (cfg.add_lm_head or cfg.loss == "nce"):
        raise UserError("--freeze_body trains only the LM head; it needs --add_lm_head (or use finetune.py)")


def check_objective(cfg: TrainConfig) -> None:
    """The objective's settings: each extra they need is there, and none is given where it changes nothing."""
    if cfg.loss == "ce":
        unused = [f"--{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(LossConfig)
                  if f.metadata.get("contrastive") and getattr(cfg, f.name) != f.default]
        if unused:
            raise UserError(f"{', '.join(unused)}: cross-entropy scores every token of the vocabulary, with no "
                            "temperature nor negatives; drop it for --loss=ce, or pick a contrastive --loss")
    if cfg.loss_chunk_size:
        common.need_extra("chunked", "--loss_chunk_size")
    if not cfg.paper_negatives:
        common.need_extra("negatives", "--negatives, --num_negatives or --negatives_scope")
    if cfg.objective == "mlm":
        common.need_extra("masking", "--objective=mlm")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr (or constant, as the paper's text has the fine-tune)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


# Where the weights come from: a fresh model, the run's own checkpoint (--resume), or another run's
# (--init_from, which is what a fine-tune is)


# What the loop counts (State) travels in the checkpoint, with the rest a run saves: checkpoint.py declares it


# What makes a resumed run the same experiment: the fields whose rule is "resume": "same" (the data, the batch, the
# model, every setting of the objective that changes its loss). Any other given may change (--max_iters extends it).
RESUME_SAME = tuple(f.name for f in dataclasses.fields(TrainConfig) if doors.field_meta(TrainConfig, f.name).get(
    "resume") == "same")


@dataclass(frozen=True)
class Plan:
    """A run's whole plan, settled (settle) before it touches anything: its effective settings, the checkpoint its
    weights come from (its own on --resume, --init_from's, or none: "") and what a resume changes."""
    cfg: TrainConfig
    source: str = ""
    resuming: bool = False
    changed: dict[str, list] = field(default_factory=dict)  # settings given on --resume unlike the run's: [was, now]


def settle(cfg: TrainConfig, given: frozenset[str], idle: Callable[[TrainConfig], dict] | None = None) -> Plan:
    """The effective settings, in one step with no side effect: the flags and --config (`given`: the names given),
    the checkpoint's document (the run's own on --resume, else --init_from's: its settings and counts, no tensor
    read: load.source_document), the preset; then every check on them, once (ranges, rules between settings,
    `idle`: the script's idle_settings among those given, what a resume must keep). Nothing is prepared, picked or
    written."""
    if cfg.resume and cfg.overwrite:  # the command's own flags, before what they name is read
        raise UserError("--resume continues the run in --out_dir and --overwrite starts it over; pass one of them")
    ckpt = run_folder.run_files(cfg.out_dir)[0]
    resuming = run_folder.resumes(cfg.out_dir, cfg.resume)
    if cfg.resume is True and not resuming:
        raise UserError(f"--resume: {ckpt} not found; pass the run's --out_dir, or start without --resume")
    source = str(ckpt) if resuming else cfg.init_from
    start = source_document(source, TrainConfig) if source else None
    before = start.train_config if start else {}
    changed = {}
    if resuming:  # the same experiment: what is not given is the run's own
        if start.state is None or start.state.micro_batches is None:
            raise UserError(f"{source} was written before runs counted their data position, so it cannot resume "
                            f"exactly; start a new run from its weights with --init_from={source}")
        cfg = resumed_settings(cfg, given, before, source)
        changed = {k: [before[k], getattr(cfg, k)] for k in sorted(given & set(before))
                   if getattr(cfg, k) != before[k] and doors.field_meta(TrainConfig, k).get("resume") != "here"}
    check_config(cfg)
    if idle:
        cli.refuse_idle(cfg, {k: why for k, why in idle(cfg).items() if k in given})
    cfg = with_schedule(cfg, before, start.state.step if resuming else None, given)
    cfg = with_model(cfg, dataclasses.asdict(start.model_config) if start else None, source)
    if start:
        check_continuation(cfg, start, source, resuming)
    common.through_door(doors.check_step, cfg.batch_size, cfg.grad_accum, cfg.block_size)
    return Plan(cfg, source, resuming, changed)


def starting_point(plan: Plan, meta: dict, device: torch.device) -> tuple[GPT, State, Checkpoint | None]:
    """A fresh model, else the checkpoint the plan resumes or starts from, through its whole door now (its
    checksum, every tensor): the model, the counts, and the checkpoint started from (if any)."""
    cfg = plan.cfg
    if devices.ranks_agree(cfg, device, plan.resuming) not in (0, ddp.world_size()):  # same settings everywhere
        raise UserError(f"{plan.source} is seen by some ranks and not others: --out_dir must be on a filesystem "
                        "every node shares")
    if not plan.source:
        return fresh_model(cfg, meta), State(), None
    source = plan.source
    start = load_source(source, TrainConfig)
    check_data(meta, start, source, cfg.dataset)
    model = checkpoint_model(start, source, dropout=cfg.dropout)
    if plan.resuming:
        return model, dataclasses.replace(start.state), start
    fit_output_layer(model, cfg, source)
    # A run from a checkpoint (a fine-tune) reads on in the data stream where its source stopped, so that the two
    # together read each micro-batch of the stream once, as one run as long would (compare.py's CE reference does)
    earlier = State(micro_batches=(start.state.micro_batches or 0) if start.state else 0,
                    earlier_tokens=start.pretrain_tokens(), earlier_flops=start.pretrain_flops())
    return model, earlier, start


def resumed_settings(cfg: Any, given: frozenset[str], before: dict, source: str | Path) -> Any:
    """The one rule of --resume, by each field's "resume" (doors.field_meta): a setting not given is the run's own
    (`before`: its saved train_config); a given one applies from here on ("kept"), or must be the run's own
    ("same": another value is another experiment); "here" ones are this command's. train.py and finetune.py."""
    kept = {}
    for f in dataclasses.fields(cfg):
        rule = doors.field_meta(type(cfg), f.name).get("resume", "kept")
        if rule == "here" or f.name not in before:
            continue
        value = getattr(cfg, f.name)
        if f.name not in given:
            kept[f.name] = before[f.name]
        elif rule == "same" and value != before[f.name]:
            raise UserError(f"--{f.name}={cli.brief_value(value)} but {source} was trained with "
                            f"--{f.name}={cli.brief_value(before[f.name])}; resume with the same --{f.name} (or "
                            "without it), or use another --out_dir for another experiment")
    return dataclasses.replace(cfg, **kept)


def with_schedule(cfg: TrainConfig, before: dict, resumed_step: int | None = None,
                  given: frozenset[str] = frozenset()) -> TrainConfig:
    """The preset (the checkpoint's, else tiny) and the schedule: the warmup and final lr not set take the preset's
    recipe (a resumed run has its own: resumed_settings); a longer --max_iters that stretches a resumed cosine
    says so."""
    preset = cfg.preset or before.get("preset") or "tiny"
    recipe = RECIPES.get(preset, DEFAULT_RECIPE)
    warmup = cfg.warmup_iters
    if warmup is None:
        warmup = max(1, round(recipe["warmup"] * cfg.max_iters))
    min_lr = recipe["final_lr"] * cfg.lr if cfg.min_lr is None else cfg.min_lr
    new = dataclasses.replace(cfg, preset=preset, warmup_iters=warmup, min_lr=min_lr)
    check_stop_at(new, resumed_step)
    if new.min_lr > new.lr and ("min_lr" in given or resumed_step is None):  # the fix: what was given
        whose = "given" if "lr" in given or resumed_step is None else "this run resumes with"
        raise UserError(f"--min_lr={new.min_lr:g} is above the lr {new.lr:g} {whose}; lower --min_lr (at most "
                        f"{new.lr:g}), or raise --lr")
    if new.min_lr > new.lr:
        raise UserError(f"--lr={new.lr:g} is below the min_lr {new.min_lr:g} this run resumes with; pass --min_lr too "
                        "(at most --lr)")
    old = dataclasses.replace(new, max_iters=before.get("max_iters", new.max_iters))
    if resumed_step is not None and old.max_iters != new.max_iters and new.lr_schedule == "cosine":
        note(f"note: --max_iters changed from {old.max_iters} to {new.max_iters} on resume: the cosine schedule now "
             f"decays over {new.max_iters} steps (lr at step {resumed_step}: {lr_at(resumed_step, new):.2e}, was "
             f"{lr_at(resumed_step, old):.2e})")
    return new


def check_stop_at(cfg: TrainConfig, resumed_step: int | None) -> None:
    """--stop_at ends this command early on the schedule of --max_iters: a step still ahead, before the end."""
    if cfg.stop_at is not None and cfg.stop_at >= cfg.max_iters:
        raise UserError(f"--stop_at={cfg.stop_at} changes nothing: the run ends at --max_iters={cfg.max_iters}; "
                        f"drop it, or stop earlier (below {cfg.max_iters})")
    if cfg.stop_at is not None and resumed_step is not None and cfg.stop_at <= resumed_step:
        raise UserError(f"--stop_at={cfg.stop_at} but the run is at step {resumed_step} already; pass a later step "
                        f"(below --max_iters={cfg.max_iters}), or drop it to go on to the end")


def with_model(cfg: TrainConfig, before: dict | None = None, source: str | Path = "") -> TrainConfig:
    """The model's settings filled in, by one rule: a fresh run takes each flag given, else the preset's value, else
    GPTConfig's default; a run from a checkpoint (`before`: its model_config) takes the checkpoint's value, and a flag
    that contradicts it is refused, but for what may change on purpose: dropout, and a shorter block_size (windows
    shorter than the model's context). The whole model is then checked as the checkpoint door checks one."""
    given = {name: getattr(cfg, name) for name in MODEL_FIELDS if getattr(cfg, name) is not None}
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    if before is None:
        values = {**defaults, **PRESETS[cfg.preset], **given}
        derived = derived_fields(cfg, {"vocab_size": 1})  # the data's vocabulary, unread yet, fits any shape
    else:
        values = {name: before.get(name, defaults[name]) for name in MODEL_FIELDS}
        for name, value in given.items():
            may_change = name == "dropout" or (name == "block_size" and value <= values[name])
            if value != values[name] and not may_change:
                raise UserError(f"--{name}={value} but {source} holds a model with {name}={values[name]}; drop "
                                f"--{name} (a run from a checkpoint keeps its model), or train a fresh model")
        values.update(given)
        derived = {name: before[name] for name in DERIVED}
    if why := doors.model_config_problem({**values, **derived}, GPTConfig, name=""):
        raise UserError(f"the model's settings do not fit together: {why}; change them (--help lists them)")
    return dataclasses.replace(cfg, **{name: values[name] for name in MODEL_FIELDS})


def derived_fields(cfg: TrainConfig, meta: dict) -> dict[str, Any]:
    """The model fields that other settings decide, for a fresh model: an encoder gets room for the [MASK] id past
    the tokenizer's ids; a separate output matrix for nce and --untied_head."""
    mlm = cfg.objective == "mlm"
    return {"vocab_size": padded_vocab_size(meta["vocab_size"] + mlm), "causal": not mlm,
            "lm_head": cfg.loss == "nce" or cfg.untied_head}


def fresh_model(cfg: TrainConfig, meta: dict) -> GPT:
    """The model of the settings, as with_model filled them in."""
    return GPT(GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS}, **derived_fields(cfg, meta)))


def lineage_init(cfg: TrainConfig, model: GPT, start: Checkpoint | None) -> Init | None:
    """What rebuilds the initial weights of this run's lineage exactly (analyze.py's drift): a fresh model's seed
    and shape (torch is seeded at the start of Run, and nothing draws before the model is built), else what the
    checkpoint it resumes or starts from carries (None for hf: imports and older checkpoints)."""
    if start is not None:
        return start.init
    return Init(seed=cfg.seed, model_config=dataclasses.replace(model.config))


def fit_output_layer(model: GPT, cfg: TrainConfig, source: str | Path) -> None:
    """A checkpoint's output layer as this run needs it: a head made from E (a fine-tune, --untied_head),
    or none for CWT (nothing would train it: it would go stale)."""
    if cfg.add_lm_head or (cfg.untied_head and model.lm_head is None):
        model.add_lm_head()
    elif cfg.loss == "cwt" and model.lm_head is not None:
        model.lm_head = None
        model.config.lm_head = False
        note(f"note: {source} has an untied LM head, but --loss=cwt trains a headless model: the head is dropped "
             "(finetune.py adds a fresh one)")
    if cfg.loss == "nce" and model.lm_head is None:
        raise UserError("--loss=nce needs a separate output table; start it fresh, not from a tied checkpoint")


def check_continuation(cfg: TrainConfig, start: Checkpoint, source: str | Path, resuming: bool) -> None:
    """A checkpoint continues as the same kind and shape of model; a resumed one longer than its step (its
    settings: resumed_settings)."""
    before = start.train_config
    encoder = not start.model_config.causal
    if resuming and cfg.max_iters < start.state.step:
        raise UserError(f"--max_iters={cfg.max_iters} is below the step {start.state.step} of {source}")
    if encoder and cfg.objective != "mlm":
        raise UserError(f"{source} is a masked-LM encoder but this run's --objective is {cfg.objective}; continue "
                        "it with --objective=mlm, or fine-tune it with glue.py")
    if not encoder and cfg.objective == "mlm":
        raise UserError(f"{source} is a causal decoder but this run's --objective is mlm; --objective=mlm starts "
                        "fresh or from an encoder")
    if cfg.preset not in (None, before.get("preset")) and before.get("preset"):
        raise UserError(f"--preset={cfg.preset} but {source} holds a {before['preset']} model; "
                        f"{'resume' if resuming else 'start from it'} with --preset={before['preset']} or without")


def check_data(meta: dict, start: Checkpoint, source: str | Path, dataset: str) -> None:
    """A checkpoint continues on data of its own tokenizer, and on its own dataset only as it was (check_same_data):
    checked once the data is opened."""
    theirs = start.data_meta
    check_same_data(meta, start, source, dataset)
    if theirs.get("tokenizer") and not same_tokenizer(theirs, meta):
        raise UserError(f"{source} was trained with tokenizer {theirs['tokenizer']!r} but the dataset uses "
                        f"{meta['tokenizer']!r} (another vocabulary); prepare the data with the same --tokenizer")


# The objective, and validation


def objective_loss(h: torch.Tensor, y: torch.Tensor, input_embedding: torch.Tensor, output_weight: torch.Tensor,
                   config: LossConfig, generator: torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
    """loss.training_loss against the paper's negatives; other negatives (--negatives, --num_negatives,
    --negatives_scope) are negatives.py's, imported only then."""
    if config.paper_negatives:
        return training_loss(h, y, input_embedding, output_weight, config, generator)
    from negatives import training_loss_with_negatives  # the extra, not in the paper
    return training_loss_with_negatives(h, y, input_embedding, output_weight, config, generator)


class Objective(torch.nn.Module):
    """The model and its loss as one module: DDP averages the gradients of what runs through its forward
    (hidden states, then the loss against the embeddings), torch.compile fuses both, and the optimizer takes
    every parameter it holds. A piece of the loss that learns or keeps state (a temperature) is a parameter or
    buffer declared here: it trains, is saved with the checkpoint and restored on --resume, and eval.py and
    compare.py score with it, with no other code (docs/hacking.md)."""

    def __init__(self, model: GPT, config: LossConfig, mask: Any = None):
        super().__init__()
        self.model = model
        self.config = config
        self.mask = mask  # an encoder's masking.Masking: the masked positions only, no MLM transform head

    def settings(self) -> LossConfig:
        """The loss settings the losses run with: the run's flags; a learned piece (a temperature) goes in here."""
        return self.config

    def size_for(self, rows: int) -> None:
        """Called once the run knows the rows a micro-batch scores (scored_rows), before the objective's state is
        restored and its optimizer built: a piece sized by the run (a queue of k micro-batches of past targets:
        k x rows) is declared here, on the model's device, with no change to the constructor a fork subclasses.
        The vocabulary is self.model.config.vocab_size. Nothing to size in the paper's objective."""

    def scored(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states and targets of the positions the loss scores: every one, or an encoder's masked ones."""
        h = self.model.hidden(x)
        return self.mask.scored(h, y) if self.mask else (h, y)

    def forward(self, x: torch.Tensor, y: torch.Tensor,
                generator: torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
        h, y = self.scored(x, y)
        return objective_loss(h, y, self.model.wte.weight, self.model.output_weight, self.settings(), generator)

    def validation_sums(self, x: torch.Tensor, y: torch.Tensor, y_bytes: torch.Tensor | None,
                        special: torch.Tensor) -> dict[str, torch.Tensor]:
        """One validation batch's loss.validation_sums."""
        h, y = self.scored(x, y)
        return validation_sums(h, y, self.model.output_weight, self.settings(), self.contrastive_table(), y_bytes,
                               special)

    def contrastive_table(self) -> torch.Tensor | None:
        return contrastive_table(self.model, self.config.loss, encoder=self.mask is not None)

    def own_state(self) -> dict[str, torch.Tensor]:
        """Its state beyond the model's: what checkpoints save under "objective"."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.")}

    def load_own_state(self, saved: dict[str, torch.Tensor], source: str | Path, exactly: bool = True) -> None:
        """Restore own_state from a checkpoint's "objective", checked first against what this objective declares
        (names, shapes, dtypes): exactly so on --resume, where a missing piece is refused; from another run
        (--init_from), the matching pieces."""
        mine = self.own_state()
        if not exactly:  # another run's: the pieces of the same name and shape; the others start fresh
            saved = {k: v for k, v in saved.items() if k in mine and v.shape == mine[k].shape}
            mine = {k: mine[k] for k in saved}
        if why := checkpoint.declared_tensors_problem(saved, mine, "its objective"):
            raise UserError(f"{source}: {why} this run's objective declares; resume with the code that wrote it, or "
                            f"start a new run from its weights with --init_from={source}")
        with torch.no_grad():
            for name, value in saved.items():
                mine[name].copy_(value)


def objective_of(ckpt: Checkpoint, model: GPT, source: str | Path = "the checkpoint") -> Objective:
    """The objective a checkpoint was trained with, around its model: its loss settings and learned state, and an
    encoder's masking. What eval.py and compare.py validate with, so that a fork's new piece needs no edit there."""
    mask = None
    if not model.config.causal:
        from masking import Masking
        mask = Masking(spec=ckpt.mask_spec)
    settings = ckpt.train_config
    objective = Objective(model, LossConfig.of(settings), mask)
    block = settings.get("block_size") or model.config.block_size
    objective.size_for(scored_rows(settings.get("batch_size", 1), block, mask))
    objective.load_own_state(ckpt.objective, source)
    return objective


def own_buffers() -> dict[str, bool]:
    """DDP's argument that keeps each rank's buffers its own after the start (torch 2.13 renamed it)."""
    import inspect
    takes = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in takes else {"broadcast_buffers": False}


def scored_rows(batch_size: int, block_size: int, mask: Any = None) -> int:
    """The rows a micro-batch's loss scores: every position, or an encoder's masked ones."""
    return mask.scored_rows(batch_size, block_size) if mask else batch_size * block_size


@dataclass(frozen=True, kw_only=True)
class Validation:
    """How evaluate scores a split: batch_size sequences of block_size tokens, on `device` under `dtype`; the first
    max_batches batches (None: all); `compile`: full batches through a compiled graph of their own (a short last
    one eagerly, rather than compile another). A setting a fork adds goes here, not in evaluate's arguments."""
    batch_size: int
    block_size: int
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    max_batches: int | None = None
    compile: bool = False


def evaluate(objective: Objective, split: ValSplit, how: Validation) -> dict[str, float]:
    """Validation of an objective on the split's first batches, each rank every world_size-th: val_ce; where it
    has a contrastive table, val_cwt and val_acc; where the split has the bytes each token stands for, val_bpb. An
    encoder is scored on fixed masks."""
    was_training = objective.training
    objective.eval()
    totals = torch.zeros(len(VAL_SUMS), dtype=torch.float64, device=how.device)
    special = torch.tensor(split.special, dtype=torch.long, device=how.device)
    batches = sequential_batches(split.tokens, how.batch_size, how.block_size, how.device, how.max_batches,
                                 ddp.rank(), ddp.world_size(), split.byte_counts)
    sums_of = objective.validation_sums
    compiled = torch.compile(sums_of, fullgraph=True, dynamic=False) if how.compile else sums_of
    with torch.no_grad():
        for i, x, y, y_bytes in batches:
            if objective.mask:
                x, y = objective.mask.validation_batch(x, i)
            with devices.autocast_context(how.device, how.dtype):
                sums = (compiled if x.size(0) == how.batch_size else sums_of)(x, y, y_bytes, special)
            totals += torch.stack([sums[name] for name in VAL_SUMS])
    objective.train(was_training)
    sums = dict(zip(VAL_SUMS, ddp.all_reduce_sum(totals).tolist()))
    if sums["tokens"] == 0:
        raise UserError("validation scored no tokens: the split is shorter than one block; use a smaller "
                        "--block_size")
    return val_metrics(sums, objective.contrastive_table() is not None, split.byte_counts is not None)


# The run: everything the loop needs, built once; one step; logs; checkpoints

NEGATIVES_STREAM = 1  # the random streams of a micro-batch besides its data (data.py) and masks (masking.py)
DROPOUT_STREAM = 2


def stream_seed(seed: int, index: int, stream: int) -> int:
    """The seed of micro-batch `index`'s draws in a random stream: (seed, index, stream) hashed (numpy's
    SeedSequence), so that no two runs' micro-batches share draws (seed * 1_000_003 + index would: seed 1337 at
    index 1,000,003 is seed 1338 at index 0)."""
    return int(np.random.SeedSequence([seed, index, stream]).generate_state(1, np.uint64)[0])


def run_dtype(plan: Plan, device: torch.device) -> torch.dtype:
    """What the run computes in: its dtype on this device (auto: devices.pick_dtype), recorded as it resolved so that
    a resume continues in it; a resumed run whose dtype this device lacks is refused (it would not be the same run)."""
    name = plan.cfg.dtype
    lacks = (name == "float16" and device.type != "cuda"
             or name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported())
    if plan.resuming and lacks:
        raise UserError(f"{plan.source} computes in {name}, which this {device.type} device lacks; resume it where "
                        "it has it, or pass --dtype=float32 to go on in another precision (no longer exact)")
    return devices.pick_dtype(name, device)


class Run:
    """One training run. Built (the start: data, weights, objective, optimizer, all restored on --resume),
    then driven by train(): validate, step, log_progress, save."""

    tracker = None  # while train() runs with --tensorboard or --wandb: tracking.Tracker, which Run.log feeds

    def __init__(self, plan: Plan | TrainConfig, given: Iterable[str] | None = None):
        if not isinstance(plan, Plan):  # built in code (a notebook, a test): its plan first
            plan = settle(plan, cli.given_settings(plan, given))
        cfg = plan.cfg
        self.device = ddp.init_distributed(devices.pick_device(cfg.device))  # under torchrun, this rank's GPU
        self.dtype = run_dtype(plan, self.device)
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left
        data_dirs = [dataset_dir(name, cfg.data_root) for name in cfg.dataset.split(",")]  # prepared: prepared_datasets
        first = common.through_door(doors.dataset, data_dirs[0])  # meta.json, and any tokenizer.json (checked)
        meta = first.meta
        self.out_dir = Path(cfg.out_dir)
        model, self.state, start = starting_point(plan, meta, self.device)
        resuming = plan.resuming
        cfg = dataclasses.replace(cfg, dtype=str(self.dtype).removeprefix("torch."))  # recorded as it resolved
        self.cfg = cfg
        self.resumed_step = start.state.step if resuming else None
        self.changed = [f"--{name}={cli.brief_value(now)} (the run had {cli.brief_value(was)})"
                        for name, (was, now) in plan.changed.items()]  # in the first record after a resume
        self.run_id = start.run_id if resuming else run_folder.new_run_id()  # in its checkpoint and log records
        self.model = model = model.to(self.device)
        for name, p in model.named_parameters():
            p.requires_grad = not cfg.freeze_body or name.startswith("lm_head.")
        self.mask = None
        if cfg.objective == "mlm":
            from masking import Masking  # BERT masking of every batch, validation on fixed masks
            self.mask = Masking(meta, cfg.seed)
        self.objective = Objective(model, LossConfig.of(cfg), self.mask).to(self.device)
        self.scored_rows = scored_rows(cfg.batch_size, cfg.block_size, self.mask)
        self.objective.size_for(self.scored_rows)
        if start is not None:  # its learned pieces: exactly on --resume; those that fit from another run
            self.objective.load_own_state(start.objective, plan.source, exactly=resuming)
        self.optimizer = adamw(self.objective, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        if resuming:
            self.restore(start)
        self.block = cfg.block_size
        vocab = model.config.vocab_size
        if len(data_dirs) == 1:
            self.sampler = BatchSampler(open_split(data_dirs[0], "train", vocab), cfg.batch_size, self.block, cfg.seed,
                                        self.device)
        else:  # micro-batch i from a source drawn by (seed, i), p ~ tokens^mix_alpha
            from mixing import MixedSampler
            self.sampler = MixedSampler(data_dirs, cfg, self.block, vocab, self.device)
        self.val_splits = {d.name: open_val_split(d, vocab, bytes=not self.mask) for d in data_dirs}
        self.tokens_per_step = cfg.grad_accum * ddp.world_size() * cfg.batch_size * self.block
        self.saved_with = dict(  # what each checkpoint carries besides the weights and the counts
            data_meta=meta, mask_spec=self.mask.spec if self.mask else None, tokenizer_json=first.tokenizer_json,
            run_id=self.run_id, init=lineage_init(cfg, model, start),
            mix=dict(zip(self.sampler.names, self.sampler.probabilities)) if len(data_dirs) > 1 else None)
        self.saved_step = None
        if cfg.compile:  # one graph for every objective: a graph break would be an error (tests/test_compile.py)
            self.objective.compile(fullgraph=True)
        self.wrapped = self.objective  # what runs each micro-batch: under torchrun, DDP-wrapped
        if ddp.world_size() > 1:  # rank 0's weights to every rank; gradients averaged over ranks in backward.
            # Buffers are not broadcast at each forward: the model's are the same on every rank, and one of the
            # objective's may hold each rank's own state (a queue of its past targets)
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.objective, gradient_as_bucket_view=True,
                                                                     **own_buffers())
        self.describe()

    def restore(self, resumed: Checkpoint) -> None:
        """Continue exactly: the optimizer, the fp16 loss scale, the random state (the weights are in already)."""
        common.through_door(checkpoint.resumable, self.out_dir / "ckpt.safetensors", resumed,
                            self.optimizer.param_groups, self.objective.named_parameters())  # its state fits
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(resumed.optimizer)
        except (KeyError, ValueError):
            raise UserError(f"{self.out_dir / 'ckpt.safetensors'} holds the optimizer of other trainable parameters; "
                            "resume with the interrupted run's settings (--freeze_body, --loss)") from None
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)  # this run's betas, decay and eps (the saved run's unless a flag changed them)
        if self.scaler.is_enabled() and resumed.scaler:
            self.scaler.load_state_dict(dataclasses.asdict(resumed.scaler))
        torch.set_rng_state(resumed.rng.torch)
        if self.device.type == "cuda" and resumed.rng.cuda is not None:
            torch.cuda.set_rng_state(resumed.rng.cuda)

    def describe(self) -> None:
        cfg = self.cfg
        if cfg.num_negatives is not None and cfg.loss != "ce" and ddp.is_main_process():
            from negatives import warn_if_every_negative
            warn_if_every_negative(cfg.num_negatives, self.candidates())
        trainable = sum(p.numel() for group in self.optimizer.param_groups for p in group["params"])
        ranks = f" x {ddp.world_size()} ranks" if ddp.world_size() > 1 else ""
        dtype = str(self.dtype).removeprefix("torch.")
        note(f"model {cfg.preset}: {self.model.num_params(False) / 1e6:.2f}M parameters without embeddings, "
             f"{self.model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
             f"{self.device.type}{ranks} {dtype} | {self.tokens_per_step:,} tokens/step")

    def log(self, record: dict) -> None:
        """The one writer of log.jsonl: every record carries the step, the tokens seen and the run's id."""
        if ddp.is_main_process():
            record = {"step": self.state.step, "tokens": self.state.tokens, **record, "run_id": self.run_id}
            if self.changed:
                record["changed"], self.changed = self.changed, []
            append_log(self.out_dir, record)
            if self.tracker:
                self.tracker.log(record)

    def validation_due(self) -> bool:
        """At every eval_interval-th step and the last, unless done: a run stopped at one owes it to --resume."""
        step = self.state.step
        at_point = step % self.cfg.eval_interval == 0 or step == self.cfg.max_iters
        return at_point and self.state.val_step != step

    def validate(self) -> None:
        """Validation metrics, printed and logged; a non-finite one stops the run before any save."""
        cfg = self.cfg
        how = Validation(batch_size=cfg.batch_size, block_size=self.block, device=self.device, dtype=self.dtype,
                         max_batches=cfg.eval_batches, compile=cfg.compile)
        try:  # the metrics' rule (loss.val_metrics): each finite, or None where it scored no rows
            per_source = {name: evaluate(self.objective, split, how) for name, split in self.val_splits.items()}
        except NotFinite as e:
            what = "validation loss" if e.name == "val_ce" else f"validation {e.name}"
            raise diverged(what, e.value, self.state.step, self.out_dir / "ckpt.safetensors") from None
        val = self.sampler.combine(per_source) if len(per_source) > 1 else per_source.popitem()[1]
        note(f"step {self.state.step}: " + " | ".join(f"{k} {common.format_metric(v)}" for k, v in val.items()))
        self.log(val)
        self.state.val = val
        self.state.val_step = self.state.step
        self.state.first_val = self.state.first_val or val

    def step(self, negatives_rng: torch.Generator) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches; returns the summed (detached) loss."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.state.step, cfg)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            # Micro-batch i of the stream is a function of (seed, i) alone, whoever draws it: a step takes
            # world_size x grad_accum consecutive ones, rank r the r-th run of grad_accum.
            index = self.state.micro_batches + ddp.rank() * cfg.grad_accum + micro
            x, y = self.sampler.get(index)
            if self.mask:
                x, y = self.mask.training_batch(x, index)
            order = None  # sampled negatives: drawn here from (seed, i), so that no generator runs in a compiled graph
            if cfg.num_negatives:
                rng = negatives_rng.manual_seed(stream_seed(cfg.seed, index, NEGATIVES_STREAM))
                order = torch.randperm(y.numel() * ddp.world_size(), generator=rng).to(self.device)
            torch.manual_seed(stream_seed(cfg.seed, index, DROPOUT_STREAM))  # dropout masks too
            last = micro == cfg.grad_accum - 1  # DDP all-reduces the gradients once, after the last one
            with self.wrapped.no_sync() if ddp.world_size() > 1 and not last else contextlib.nullcontext():
                with devices.autocast_context(self.device, self.dtype):
                    loss = self.wrapped(x, y, order) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            self.state.flops += self.flops_of(y)
        optimizer_step(self.optimizer, self.objective.parameters(), cfg.grad_clip, self.scaler)
        self.state.step += 1
        self.state.micro_batches += cfg.grad_accum * ddp.world_size()
        self.state.tokens += self.tokens_per_step
        return loss_sum

    def candidates(self) -> int:
        """The candidates a contrastive loss scores each row against: the scored rows of this rank's micro-batch,
        or of every rank's under --negatives_scope=global."""
        return self.scored_rows * (ddp.world_size() if self.cfg.negatives_scope == "global" else 1)

    def flops_of(self, y: torch.Tensor) -> float:
        """Training FLOPs of every rank's micro-batch like this one (targets y): unique negatives score the
        distinct targets, counted on the batch; any other loss a fixed number of columns."""
        cfg = self.cfg
        candidates = self.candidates()
        if cfg.negatives == "unique" and cfg.loss != "ce":
            from negatives import distinct_targets
            candidates = distinct_targets(y, cfg.negatives_scope)
        columns = scored_columns(cfg.loss, self.model.config.vocab_size, candidates, cfg.num_negatives)
        share = self.scored_rows / (cfg.batch_size * self.block)  # of the positions, those the loss scores
        per_token = self.model.flops_per_token(self.block, share * columns, body_backward=not cfg.freeze_body)
        return per_token * cfg.batch_size * self.block * ddp.world_size()

    def log_progress(self, loss_sum: torch.Tensor, stop: common.StopFlag, since: tuple[float, int]) -> bool:
        """One all-reduce (the mean loss over ranks, and whether any rank must stop), a progress line (tokens/s and
        MFU since `since`: a (time, step) pair) and a log record; returns whether to stop."""
        cfg = self.cfg
        state = self.state
        totals = ddp.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(stop.requested), device=self.device)]))
        state.loss = totals[0].item() / ddp.world_size()
        if not math.isfinite(state.loss):
            raise diverged("loss", state.loss, state.step, self.out_dir / "ckpt.safetensors")
        lr = lr_at(state.step - 1, cfg)
        tok_s = (state.step - since[1]) * self.tokens_per_step / max(time.time() - since[0], 1e-9)
        eta = int((cfg.max_iters - state.step) * self.tokens_per_step / tok_s)
        peak = devices.peak_flops(self.device)
        mfu = {"mfu": tok_s / ddp.world_size() * state.flops / state.tokens / peak} if peak else {}  # a share
        shown = f" | MFU {100 * mfu['mfu']:.1f}%" if peak else ""
        note(f"step {state.step}/{cfg.max_iters} | loss {state.loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
             f"ETA {eta // 3600}h{eta % 3600 // 60:02d}m{eta % 60:02d}s{shown}")
        self.log({"loss": state.loss, "lr": lr, "tokens_per_s": tok_s, **mfu})
        return totals[1].item() > 0

    def save(self, stop: common.StopFlag) -> None:
        """All it takes to continue exactly, and what it took to get here (once a step)."""
        if self.saved_step == self.state.step:
            return
        self.saved_step = self.state.step
        if not ddp.is_main_process():
            return
        scaler = self.scaler.state_dict()  # empty when disabled
        ckpt = Checkpoint(
            model=self.model.state_dict(), model_config=self.model.config, objective=self.objective.own_state(),
            optimizer=self.optimizer.state_dict(), scaler=Scaler(**scaler) if scaler else None,
            train_config=dataclasses.asdict(self.cfg), state=self.state, **self.saved_with,
            rng=Rng(torch=torch.get_rng_state(),
                    cuda=torch.cuda.get_rng_state() if self.device.type == "cuda" else None))
        with stop.deferred():
            save_checkpoint(self.out_dir / "ckpt.safetensors", ckpt)


# The loop


def train(cfg: TrainConfig, given: Iterable[str] | None = None,
          idle: Callable[[TrainConfig], dict] | None = None) -> dict[str, Any]:
    """Run training as configured; returns a summary (first and last validation, tokens, FLOPs, and whether
    a signal stopped it: `interrupted`, the signal's number in `signal`). `given`: the names of the settings the
    user gave (cli.parse_given; None: those cfg sets to other than their defaults): on --resume, the others are
    the run's own; `idle`: settle's. The paths given are declared (io_checks.declare_io), its plan settled (settle),
    the data it reads declared from the plan, and out_dir claimed (its lock taken), before anything is built."""
    starts_from = None if run_folder.resumes(cfg.out_dir, cfg.resume) else cfg.init_from  # a resume reads its own
    declared = io_checks.declare_io(reads={"--init_from": starts_from}, writes={"--out_dir": run_folder.run_files(
        cfg.out_dir)}, kinds={"--init_from": "start"})  # the paths given, before a byte of them is read
    if ddp.launched_as_rank_0():  # a live run's folder is named at once, before its checkpoint is read
        run_folder.check_out_dir(Path(cfg.out_dir))
    plan = settle(cfg, cli.given_settings(cfg, given), idle)
    cfg = plan.cfg
    declared.also_reads("--dataset", [dataset_dir(name, cfg.data_root) for name in cfg.dataset.split(",")])
    out_dir = Path(cfg.out_dir)
    with run_folder.claim_out_dir(out_dir, cfg.resume, cfg.overwrite), run_folder.compiler_cache(out_dir):
        prepared_datasets(cfg)  # the one write outside out_dir: the built-in corpus, if missing
        return train_claimed(plan)


def train_claimed(plan: Plan) -> dict[str, Any]:
    """train() in its claimed out_dir, its data prepared."""
    run = Run(plan)
    cfg = run.cfg
    state = run.state
    negatives_rng = torch.Generator()
    started = time.time()
    since = (started, state.step)  # tokens/s counts training time only: validation restarts the clock
    stopping = False
    run.model.train()
    run_folder.start_log(run.out_dir, run.resumed_step, run.run_id)
    for change in run.changed:  # a curve's meaning changes here: said, and in the log (Run.log)
        note(f"note: resumed with {change} from step {state.step} on")
    with common.StopFlag() as stop, tracked(run):
        while True:
            if run.validation_due():
                run.validate()
                if state.step > 0:
                    run.save(stop)
                since = (time.time(), state.step)
            if state.step >= cfg.max_iters:
                break
            loss_sum = run.step(negatives_rng)
            if state.step % cfg.log_interval == 0 or state.step == cfg.max_iters:
                stopping = run.log_progress(loss_sum, stop, since)
                since = (time.time(), state.step)
            stopping = stopping or (ddp.world_size() == 1 and stop.requested)  # one process: nothing to agree
            stopping = stopping or state.step == cfg.stop_at  # planned: every rank at the same step
            if stopping:
                run.save(stop)  # a validation due at this step is owed to --resume
                break
        ddp.barrier()  # every rank returns once the checkpoint is on disk (finetune.py reads it next)
    stopping = stopping or stop.requested  # a signal at the run's very end still stops the whole command
    elapsed = time.time() - started
    ckpt = run.out_dir / "ckpt.safetensors"
    note(f"stopped at step {state.step}; checkpoint saved to {ckpt}; continue with --resume" if stopping else
         f"done: {state.step} steps in {elapsed:.0f} s; checkpoint {ckpt}")
    return {"step": state.step, "first_val": state.first_val, "val": state.val, "loss": state.loss,
            "ckpt": str(ckpt), "tokens": state.earlier_tokens + state.tokens,
            "flops": state.earlier_flops + state.flops, "interrupted": stopping,
            "signal": stop.signal if stopping else None, "seconds": elapsed}


def prepared_datasets(cfg: TrainConfig) -> list[Path]:
    """--dataset's prepared folders, the one step of a run that may write data: the built-in corpus (shakespeare,
    shakespeare-bpeN) is prepared on its first use, and a folder a killed prepare.py left mid-swap is put back; by
    rank 0 under torchrun, while the others wait (the process group is joined first; Run finds it joined)."""
    ddp.init_distributed(devices.pick_device(cfg.device))
    from prepare import ensure_dataset  # the preparing room: only this step of a run enters it
    return [ensure_dataset(name, cfg.data_root) for name in cfg.dataset.split(",")]


def tracked(run: Run) -> contextlib.AbstractContextManager:
    """--tensorboard and --wandb (tracking.py): while the loop runs, every record Run.log writes goes there too."""
    if not (run.cfg.tensorboard or run.cfg.wandb):
        return contextlib.nullcontext()
    from tracking import Tracker
    return Tracker(run)


def idle_settings(cfg: TrainConfig) -> dict[str, str]:
    """The settings a command line gives that would change nothing (refused: cli.refuse_idle)."""
    idle = {}
    if "," not in cfg.dataset:
        idle["mix_alpha"] = "without a mix (--dataset=A,B,...)"
    if cfg.lr_schedule == "constant":
        idle["min_lr"] = "with --lr_schedule=constant (the lr stays at --lr after the warmup)"
    if not cfg.init_from or run_folder.resumes(cfg.out_dir, cfg.resume):
        idle["add_lm_head"] = "without --init_from (a new model has the head its --loss needs; a resumed run its own)"
    return {**idle, **idle_anywhere(cfg)}


def idle_anywhere(cfg: TrainConfig) -> dict[str, str]:
    """The settings that change nothing in a train.py or finetune.py run alike."""
    idle = {}
    if not cfg.wandb:
        idle.update(dict.fromkeys(("wandb_project", "wandb_run_name"), "without --wandb"))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # torchrun sets it: the ranks the process group will have
        idle["negatives_scope"] = ("on one process (global scores against every rank's micro-batch: it is the local "
                                   "one here); run under torchrun")
    return idle


# --quick: a run of seconds on a CPU (30 steps of the tiny preset on short sequences), the tests' tiny_config too
QUICK = dict(preset="tiny", block_size=32, batch_size=8, max_iters=30, warmup_iters=5, eval_interval=10,
             eval_batches=2, log_interval=1)


def main(argv: list[str]) -> None:
    cfg, given = cli.parse_given(TrainConfig, argv, QUICK)
    summary = train(cfg, given, idle_settings)
    if summary["signal"] is not None:  # a planned stop (--stop_at) exits 0
        raise common.Interrupted(summary["signal"])


if __name__ == "__main__":
    common.run_main(main)

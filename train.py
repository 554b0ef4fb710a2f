"""Pre-train a decoder LM with cross-entropy or the headless Contrastive Weight Tying objective.

    python train.py                                   # tiny model, built-in Shakespeare, CWT, CPU ok
    python train.py --loss=ce                         # the usual vocabulary head (tied weights)
    python train.py --preset=pythia-70m --dataset=roneneldan/TinyStories --compile
    python train.py --objective=mlm --preset=bert-tiny               # a headless masked-LM encoder

Settings are the fields of `TrainConfig`, overridden by `--key=value` flags or `--config=FILE.json|toml`.
finetune.py and compare.py run this same loop (`train(cfg)`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from common import (DeviceName, DtypeName, UserError, all_reduce_sum, any_rank, atomic_write_text,
                    autocast_context, barrier, check_ranges, checkpoint_model, count_ranks, data_parallel,
                    format_duration, format_metric, gradient_sync, hold_lock, init_distributed,
                    is_main_process, load_checkpoint, main_process_first, optimizer_step, parse_flags,
                    peak_flops, pick_device, pick_dtype, rank, remove_stale_temps, run_main, save_checkpoint,
                    world_size)
from data import (MASK_RATE, BatchSampler, MaskSpec, ensure_dataset, load_meta, mask_spec, mask_tokens,
                  open_split)
from eval import evaluate, validation_table
from loss import LossName, masked_rows, scored_columns, training_loss
from model import GPT, PRESETS, PresetName, build_model, padded_vocab_size


@dataclass
class TrainConfig:
    # data
    dataset: str = "shakespeare"  # a prepared dataset name or folder (see data.py)
    data_root: str = "data"
    # model
    preset: PresetName | None = None  # model shape; default: tiny, or the checkpoint's when starting from one
    block_size: int | None = None  # context length; default: the preset's (tiny: 256)
    dropout: float = 0.0
    # objective
    objective: Literal["causal", "mlm"] = "causal"  # mlm: BERT masking, bidirectional attention
    loss: LossName = "cwt"
    temperature: float = 1.0
    negatives: Literal["all", "unique"] = "all"  # "unique": distinct target tokens only (not in paper)
    num_negatives: int | None = None  # score against a random subset of k candidates (not in paper)
    loss_chunk_size: int = 0  # score this many rows at a time: same loss, memory O(chunk x columns); 0 = off
    # candidates: this rank's micro-batch (paper), or every rank's (global, under torchrun; not in paper)
    negatives_scope: Literal["local", "global"] = "local"
    # optimisation
    batch_size: int = 8  # sequences per micro-batch: CWT's negatives are the other tokens in it
    grad_accum: int = 1  # micro-batches per rank per step (a step takes world_size x grad_accum of them)
    max_iters: int = 600
    lr: float = 1e-3
    min_lr: float | None = None  # default: the preset's recipe (RECIPES)
    warmup_iters: int | None = None  # default: the preset's recipe (RECIPES)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation, logging, checkpoints
    eval_interval: int = 100
    eval_batches: int = 20
    log_interval: int = 10
    out_dir: str = "out"
    resume: bool | Literal["auto"] = False  # continue from out_dir/ckpt.pt; auto: if there is one, else start
    # system
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    compile: bool = False
    seed: int = 1337
    # starting from another checkpoint (what finetune.py sets)
    init_from: str = ""  # start from this checkpoint's weights instead of a fresh model
    add_lm_head: bool = False  # give the model an untied LM head initialised from its embeddings
    freeze_body: bool = False  # train only the LM head
    # ce: a separate output matrix, as Pythia's config (the paper's CE baselines tie it)
    untied_head: bool = False


# Learning-rate recipe by preset: warmup steps and final learning rate as fractions of max_iters and lr.
# The Pythia shapes follow the paper's pre-training (lr 1e-3, betas 0.9/0.95, weight decay 0.1, clip 1:
# TrainConfig's defaults) with its cosine schedule to 0 after a 1% warmup (1430 of 143,000 steps);
# the small presets, trained for minutes, warm up over 10% of the steps and decay to lr / 10.
RECIPES = {"pythia-70m": dict(warmup=0.01, final_lr=0.0), "pythia-160m": dict(warmup=0.01, final_lr=0.0)}
DEFAULT_RECIPE = dict(warmup=0.1, final_lr=0.1)


CKPT_NAME = "ckpt.pt"
LOG_NAME = "log.jsonl"

# The valid range of every numeric setting (see common.check_ranges); unset (None) ones are not checked.
TRAIN_RANGES = {
    "batch_size": "[1, inf)", "grad_accum": "[1, inf)", "max_iters": "[1, inf)", "eval_interval": "[1, inf)",
    "eval_batches": "[1, inf)", "log_interval": "[1, inf)", "warmup_iters": "[0, inf)",
    "block_size": "[2, inf)", "num_negatives": "[1, inf)", "dropout": "[0, 1)", "temperature": "(0, inf)",
    "lr": "(0, inf)", "min_lr": "[0, lr]", "weight_decay": "[0, inf)", "beta1": "[0, 1)", "beta2": "[0, 1)",
    "eps": "(0, inf)", "grad_clip": "[0, inf)", "loss_chunk_size": "[0, inf)",
}


def check_config(cfg: TrainConfig) -> None:
    """Reject settings that cannot work, before any time is spent."""
    check_ranges(cfg, TRAIN_RANGES)
    if cfg.negatives_scope == "global" and cfg.objective == "mlm":
        raise UserError("--negatives_scope=global gathers equal-sized micro-batches; an MLM's masked "
                        "positions differ per rank: use the default --negatives_scope=local "
                        "with --objective=mlm")
    if cfg.untied_head and cfg.loss not in ("ce", "ce+cwt"):
        raise UserError("--untied_head gives cross-entropy its own output matrix; "
                        f"--loss={cfg.loss} has none")
    if cfg.freeze_body and not (cfg.add_lm_head or cfg.loss == "nce"):
        raise UserError("--freeze_body trains only the LM head; it needs --add_lm_head (or use finetune.py)")


# ----------------------------------------------------------------------------------------------
# Where the weights come from: fresh, our own checkpoint (--resume), or another run's (--init_from)


def starting_checkpoints(cfg: TrainConfig, meta: dict, ckpt_path: Path) -> tuple[dict | None, dict | None]:
    """(the checkpoint being resumed, the checkpoint started from): at most one, none for a fresh run."""
    if wants_resume(cfg, ckpt_path):
        if not ckpt_path.is_file():
            raise UserError(f"--resume: checkpoint {ckpt_path} not found; "
                            "pass the interrupted run's --out_dir, or start without --resume")
        resumed = load_checkpoint(ckpt_path)
        if resumed.get("train_config", {}).get("init_from", "") != cfg.init_from:
            raise UserError(f"{ckpt_path} was made by a different run (init_from differs); "
                            "use another --out_dir")
        check_same_tokenizer(meta, resumed, ckpt_path)
        return resumed, None
    if cfg.init_from:
        base = load_checkpoint(cfg.init_from)
        check_same_tokenizer(meta, base, cfg.init_from)
        return None, base
    return None, None


def settle_config(cfg: TrainConfig, start: dict | None, path: str | Path, resuming: bool) -> TrainConfig:
    """Fill the unset settings (None). The preset is the checkpoint's when the run starts from one (its
    model is what trains, so another --preset is refused); a resumed run keeps its own schedule; the rest
    comes from the preset's recipe."""
    recorded = (start or {}).get("train_config", {})
    preset = recorded.get("preset") if start else "tiny"
    if start and cfg.preset is not None and preset is not None and cfg.preset != preset:
        how = "resume" if resuming else "start from it"
        raise UserError(f"--preset={cfg.preset} but {path} holds a {preset} model; {how} with "
                        f"--preset={preset} or without --preset (another shape needs another run)")
    cfg = dataclasses.replace(cfg, preset=cfg.preset or preset)
    if resuming:
        cfg = dataclasses.replace(cfg, **{k: recorded.get(k) for k in ("warmup_iters", "min_lr")
                                          if getattr(cfg, k) is None})
    return with_recipe(cfg)


def starting_model(cfg: TrainConfig, meta: dict, resumed: dict | None, base: dict | None) -> GPT:
    """The checkpoint's model (with this run's dropout), or a fresh one of the preset's shape."""
    if resumed or base:
        path = Path(cfg.out_dir) / CKPT_NAME if resumed else cfg.init_from
        model = continued_model(resumed or base, path, cfg)
        if base and cfg.add_lm_head:
            model.add_lm_head()
        return model
    block = cfg.block_size or PRESETS[cfg.preset]["block_size"]
    mlm = cfg.objective == "mlm"  # an encoder, with room for the [MASK] id past the tokenizer's ids
    # `nce` needs its own output table (no weight tying)
    return build_model(cfg.preset, padded_vocab_size(meta["vocab_size"] + mlm), block_size=block,
                       dropout=cfg.dropout, lm_head=cfg.loss == "nce" or cfg.untied_head, causal=not mlm)


def wants_resume(cfg: TrainConfig, ckpt_path: Path) -> bool:
    """--resume, or --resume=auto with a checkpoint in out_dir. Every rank must see the same out_dir."""
    found = ckpt_path.is_file()
    if count_ranks(found) not in (0, world_size()):
        raise UserError(f"rank {rank()} {'sees' if found else 'does not see'} {ckpt_path} but another rank "
                        "does not: --out_dir must be on a filesystem every node shares")
    return found if cfg.resume == "auto" else cfg.resume


def continued_model(ckpt: dict, path: str | Path, cfg: TrainConfig) -> GPT:
    """A checkpoint's model, to train further with this run's dropout."""
    context = ckpt["model_config"].get("block_size", 0)
    if cfg.block_size is not None and cfg.block_size > context:
        raise UserError(f"--block_size={cfg.block_size} exceeds the checkpoint's context {context}")
    check_same_objective(ckpt, path, cfg)
    return checkpoint_model(ckpt, path, dropout=cfg.dropout)


def check_resume_settings(cfg: TrainConfig, resumed: dict, path: Path) -> None:
    """--resume continues one experiment: another objective, loss, data or batch shape is refused (with
    --resume=auto that is another experiment's out_dir). A larger --max_iters extends the run; under the
    cosine schedule that stretches the decay, which is said once."""
    before, step = resumed.get("train_config", {}), resumed["step"]
    for key in RESUME_SAME:
        if key in before and before[key] != getattr(cfg, key):
            raise UserError(f"--{key}={getattr(cfg, key)} but {path} was trained with --{key}={before[key]}; "
                            f"resume with the same --{key}, or use another --out_dir for another experiment")
    if cfg.max_iters < step:
        raise UserError(f"--max_iters={cfg.max_iters} is below the step {step} of {path}; pass a larger "
                        "--max_iters to extend the run")
    old = before.get("max_iters", cfg.max_iters)
    if old != cfg.max_iters and cfg.lr_schedule == "cosine":
        was = lr_at(step, dataclasses.replace(cfg, max_iters=old))
        print(f"note: --max_iters changed from {old} to {cfg.max_iters} on resume: the cosine schedule now "
              f"decays over {cfg.max_iters} steps (lr at step {step}: {lr_at(step, cfg):.2e}, was {was:.2e})",
              file=sys.stderr)


# What makes a run the same experiment: a resumed run may change anything else (e.g. --max_iters to extend
# it, --grad_accum with the number of GPUs, --dtype, --eval_interval).
RESUME_SAME = ("objective", "loss", "dataset", "batch_size", "block_size", "negatives", "negatives_scope")


def check_same_objective(ckpt: dict, path: str | Path, cfg: TrainConfig) -> None:
    """An encoder sees the tokens it would predict causally, and a decoder has never seen a [MASK]."""
    encoder = not ckpt["model_config"].get("causal", True)
    if encoder != (cfg.objective == "mlm"):
        kind = "a masked-LM encoder" if encoder else "a causal decoder"
        hint = "continue it with --objective=mlm, or fine-tune it with glue.py" if encoder else \
            "--objective=mlm starts fresh or from an encoder"
        raise UserError(f"{path} is {kind} but this run's --objective is {cfg.objective}; {hint}")


def check_same_tokenizer(meta: dict, ckpt: dict, where: str | Path) -> None:
    """A model only makes sense on data from the tokenizer it was trained with."""
    trained_with = ckpt.get("data_meta", {}).get("tokenizer")
    if trained_with and trained_with != meta.get("tokenizer"):
        raise UserError(f"{where} was trained with tokenizer {trained_with!r} but the dataset uses "
                        f"{meta.get('tokenizer')!r}; prepare the data with the same --tokenizer")


def restore_state(run: Run, resumed: dict) -> None:
    """Continue exactly where a checkpoint stopped: optimizer, loss scale, step, compute and RNG state."""
    try:
        run.optimizer.load_state_dict(resumed["optimizer"])
    except (KeyError, ValueError):
        raise UserError(f"{run.ckpt_path} holds the optimizer of other trainable parameters; resume with the "
                        "interrupted run's settings (--freeze_body, --loss)") from None
    if run.scaler.is_enabled() and resumed.get("scaler"):  # fp16 before and now: keep its loss scale
        run.scaler.load_state_dict(resumed["scaler"])
    run.step, run.first_val, run.val = resumed["step"], resumed.get("first_val"), resumed.get("val")
    run.earlier_tokens, run.earlier_flops = resumed["base_tokens"], resumed["base_flops"]
    torch.set_rng_state(resumed["rng"]["torch"])
    if run.device.type == "cuda" and resumed["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(resumed["rng"]["cuda"])


def with_recipe(cfg: TrainConfig) -> TrainConfig:
    """The config with its unset schedule settings (None) taken from the preset's recipe."""
    recipe = RECIPES.get(cfg.preset, DEFAULT_RECIPE)
    warmup = (cfg.warmup_iters if cfg.warmup_iters is not None
              else max(1, round(recipe["warmup"] * cfg.max_iters)))
    min_lr = cfg.min_lr if cfg.min_lr is not None else recipe["final_lr"] * cfg.lr
    return dataclasses.replace(cfg, warmup_iters=warmup, min_lr=min_lr)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr (or constant, as the paper's head fine-tune)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


# ----------------------------------------------------------------------------------------------
# A run: everything the loop reads and updates, set up once


@dataclass
class Run:
    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype
    model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    val_tokens: np.ndarray
    meta: dict
    out_dir: Path
    block_size: int
    loss_fn: torch.nn.Module  # compute_loss(model, ...) (compiled with --compile); DDP under torchrun
    tokens_per_iter: int  # over all ranks
    flops_per_token: float
    step: int = 0
    loss: float | None = None  # the last training loss read back (every log interval)
    first_val: dict | None = None
    val: dict | None = None
    earlier_tokens: int = 0  # tokens and FLOPs of the checkpoints this run started from, so budgets
    earlier_flops: float = 0.0  # and compute add up across stages (pre-training, fine-tune)
    negatives_rng: torch.Generator = dataclasses.field(default_factory=torch.Generator)
    mask_spec: MaskSpec | None = None  # --objective=mlm: the [MASK] id and the tokens never masked

    @property
    def ckpt_path(self) -> Path:
        return self.out_dir / CKPT_NAME

    @property
    def tokens(self) -> int:
        return self.step * self.tokens_per_iter


def set_up(cfg: TrainConfig) -> tuple[Run, dict | None]:
    """Device, data, model, optimizer; restored from out_dir's checkpoint with --resume. Returns the run
    and the resumed checkpoint (None for a new run)."""
    device = init_distributed(pick_device(cfg.device))  # under torchrun: this rank's GPU
    dtype = pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left
    with main_process_first():  # one rank prepares the built-in dataset, the others wait for it
        data_dir = ensure_dataset(cfg.dataset, cfg.data_root)
    meta = load_meta(data_dir)
    out_dir = Path(cfg.out_dir)
    resumed, base = starting_checkpoints(cfg, meta, out_dir / CKPT_NAME)
    cfg = settle_config(cfg, resumed or base, out_dir / CKPT_NAME if resumed else cfg.init_from,
                        resuming=resumed is not None)
    if resumed:
        check_resume_settings(cfg, resumed, out_dir / CKPT_NAME)
    model = starting_model(cfg, meta, resumed, base)
    if cfg.loss == "nce" and model.lm_head is None:
        raise UserError("--loss=nce needs a separate output table; "
                        "start it fresh, not from a tied checkpoint")
    if cfg.freeze_body:
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("lm_head.")
    model.to(device)
    block_size = cfg.block_size or model.config.block_size
    vocab_size = model.config.vocab_size
    tokens_per_micro = cfg.batch_size * block_size
    candidates = tokens_per_micro * (world_size() if cfg.negatives_scope == "global" else 1)
    columns = scored_columns_per_token(cfg, vocab_size, candidates)
    warn_if_every_negative(cfg, round(MASK_RATE * candidates) if cfg.objective == "mlm" else candidates)
    run = Run(cfg=cfg, device=device, dtype=dtype, model=model,
              optimizer=model.configure_optimizer(cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps),
              scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
              sampler=BatchSampler(open_split(data_dir, "train", vocab_size), cfg.batch_size, block_size,
                                   cfg.seed, device),
              val_tokens=open_split(data_dir, "val", vocab_size), meta=meta, out_dir=out_dir,
              block_size=block_size,
              loss_fn=data_parallel(model, torch.compile(compute_loss) if cfg.compile else compute_loss),
              tokens_per_iter=tokens_per_micro * cfg.grad_accum * world_size(),
              flops_per_token=model.flops_per_token(block_size, columns))
    run.mask_spec = mask_spec(meta) if cfg.objective == "mlm" else None
    if base:
        run.earlier_tokens = base.get("base_tokens", 0) + base.get("tokens_seen", 0)
        run.earlier_flops = base.get("base_flops", 0.0) + base.get("flops", 0.0)
    if resumed:
        restore_state(run, resumed)
    return run, resumed


def warn_if_every_negative(cfg: TrainConfig, candidates: int) -> None:
    """k negatives out of at most k candidates are all of them: say so rather than fall back silently."""
    if cfg.num_negatives is not None and cfg.loss != "ce" and cfg.num_negatives >= candidates:
        print(f"warning: --num_negatives={cfg.num_negatives} is not below the {candidates} candidates of a "
              "micro-batch (batch_size x block_size): every candidate is scored, as without it",
              file=sys.stderr)


@contextlib.contextmanager
def claim_out_dir(run: Run, resumed: dict | None):
    """out_dir for this run alone, for the run's life (a second run on it is refused); temp files of
    killed runs removed; a fresh log for a new run, and on resume the log up to the checkpoint's step.
    Under torchrun, rank 0 alone writes in out_dir, so it alone claims it."""
    if not is_main_process():
        yield
        return
    run.out_dir.mkdir(parents=True, exist_ok=True)
    with hold_lock(run.out_dir, "training run"):
        remove_stale_temps(run.out_dir)
        if resumed:
            trim_log(run.out_dir, resumed["step"])
        else:
            (run.out_dir / LOG_NAME).unlink(missing_ok=True)
        yield


def trim_log(out_dir: Path, step: int) -> None:
    """Keep the log records up to `step`: a crashed run logged steps past its last checkpoint, which the
    resumed run logs again, so the log reads as one uninterrupted run."""
    path = out_dir / LOG_NAME
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


# ----------------------------------------------------------------------------------------------
# Steps, validation, checkpoints, logs


def scored_columns_per_token(cfg: TrainConfig, vocab_size: int, tokens_per_micro: int) -> float:
    """Output vectors scored per input token, for the FLOP count: an MLM scores only its masked positions
    (MASK_RATE of them), and CWT's candidates are then those positions alone."""
    if cfg.objective == "causal":
        return scored_columns(cfg.loss, vocab_size, tokens_per_micro, cfg.num_negatives)
    masked = round(MASK_RATE * tokens_per_micro)
    return MASK_RATE * scored_columns(cfg.loss, vocab_size, masked, cfg.num_negatives)


def training_batch(run: Run, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index`: (inputs, next tokens), or for an MLM (masked inputs, targets at the masked
    positions); both a pure function of (seed, index), so a resumed run sees the same batches and masks."""
    x, y = run.sampler.get(index)
    if run.cfg.objective == "mlm":
        return mask_tokens(x, run.cfg.seed, index, run.mask_spec)
    return x, y


def compute_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
                 negatives_rng: torch.Generator) -> torch.Tensor:
    """The training objective of one micro-batch, from the model's final hidden states (for an MLM, those
    of the masked positions only: no MLM transform head, the model is headless)."""
    h = model.hidden(x)
    if cfg.objective == "mlm":
        h, y = masked_rows(h, y)
    return training_loss(h, y, model.wte.weight, model.output_weight, cfg.loss, cfg.temperature,
                         cfg.negatives, cfg.num_negatives, negatives_rng, cfg.loss_chunk_size or None,
                         cfg.negatives_scope)


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over grad_accum micro-batches; returns the mean loss (still on the device)."""
    cfg, step = run.cfg, run.step
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        index = micro_batch_index(step, micro, cfg.grad_accum)
        x, y = training_batch(run, index)  # batch i is a function of (seed, i) only
        run.negatives_rng.manual_seed(cfg.seed * 1_000_003 + index)
        torch.manual_seed(cfg.seed * 1_000_033 + index)  # dropout masks too: whichever rank draws batch i
        with gradient_sync(run.loss_fn, sync=micro == cfg.grad_accum - 1):
            with autocast_context(run.device, run.dtype):
                loss = run.loss_fn(x, y, cfg, run.negatives_rng) / cfg.grad_accum
            run.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    optimizer_step(run.optimizer, run.model.parameters(), cfg.grad_clip, run.scaler)
    run.step += 1
    return loss_sum


def validation_metrics(run: Run) -> dict[str, float]:
    """Next-token metrics of a decoder, masked-token metrics (on fixed masks) of an encoder."""
    cfg = run.cfg
    return evaluate(run.model, run.val_tokens, cfg.batch_size, run.block_size, run.device, run.dtype,
                    cfg.eval_batches, validation_table(run.model, cfg.loss, run.mask_spec), cfg.temperature,
                    run.mask_spec)


def micro_batch_index(step: int, micro: int, grad_accum: int) -> int:
    """Which micro-batch of the data stream this rank trains on. A step takes world_size x grad_accum
    consecutive ones, rank r the r-th run of grad_accum: 2 ranks x grad_accum 1 and 1 process x
    grad_accum 2 see the same batches, so results and checkpoints do not depend on the split."""
    return (step * world_size() + rank()) * grad_accum + micro


def validate(run: Run) -> dict[str, float]:
    """Validation metrics, printed and logged; non-finite ones stop the run before any save."""
    val = validation_metrics(run)
    shown = " | ".join(f"{k} {format_metric(v)}" for k, v in val.items())
    if not math.isfinite(val["val_ce"]):  # before the log: a NaN never reaches log.jsonl
        raise UserError(f"validation loss became {val['val_ce']} at step {run.step}; stopped without saving "
                        f"(the last good checkpoint is {run.ckpt_path} if any): "
                        "lower --lr or raise --warmup_iters")
    note(f"step {run.step}: {shown}")
    if is_main_process():
        append_log(run.out_dir, {"step": run.step, "tokens": run.tokens, **val})
    run.val, run.first_val = val, run.first_val or val
    return val


def checkpoint(run: Run) -> None:
    """Save everything needed to continue exactly, and what it took to get here (tokens, FLOPs).
    Rank 0 alone writes: every rank holds the same weights and optimizer state."""
    if not is_main_process():
        return
    save_checkpoint(run.ckpt_path, {
        "model": run.model.state_dict(), "model_config": dataclasses.asdict(run.model.config),
        "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(), "step": run.step,
        "loss": run.loss,
        "train_config": dataclasses.asdict(run.cfg), "data_meta": run.meta, "val": run.val,
        "first_val": run.first_val, "tokens_seen": run.tokens, "flops": run.tokens * run.flops_per_token,
        "base_tokens": run.earlier_tokens, "base_flops": run.earlier_flops,
        "mask_spec": dataclasses.asdict(run.mask_spec) if run.mask_spec else None,
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if run.device.type == "cuda" else None}})


def note(message: str) -> None:
    """A status line on stderr, from rank 0 only."""
    if is_main_process():
        print(message, file=sys.stderr)


def append_log(out_dir: Path, record: dict) -> None:
    with open(out_dir / LOG_NAME, "a") as f:
        f.write(json.dumps(record) + "\n")


def report_progress(run: Run, loss: float, seconds: float, steps: int, eta: float) -> None:
    """The progress line (loss, lr, tokens/s over the last interval, ETA, MFU on GPUs) and its log record
    (rank 0's). Tokens/s counts all ranks; MFU is per GPU."""
    if not is_main_process():
        return
    tok_s = steps * run.tokens_per_iter / max(seconds, 1e-9)
    peak = peak_flops(run.device)
    mfu = f" | MFU {100 * tok_s / world_size() * run.flops_per_token / peak:.1f}%" if peak else ""
    lr = lr_at(run.step - 1, run.cfg)
    print(f"step {run.step}/{run.cfg.max_iters} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
          f"ETA {format_duration(eta)}{mfu}", file=sys.stderr)
    append_log(run.out_dir, {"step": run.step, "tokens": run.tokens, "loss": loss, "lr": lr,
                             "tokens_per_s": tok_s})


class StopFlag:
    """SIGINT/SIGTERM ask the loop to stop after the current step, save, and exit cleanly."""

    def __init__(self):
        self.requested = False  # by a signal to this process
        self.stopping = False  # what all ranks agreed at the last `agree()`
        self._previous = {}

    def agree(self) -> bool:
        """Whether to stop, asked of every rank at the same point: any rank's signal stops them all at
        the same step (each rank's own flag may flip at any moment)."""
        self.stopping = any_rank(self.requested)
        return self.stopping

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop right away
            raise KeyboardInterrupt
        self.requested = True
        note(f"\n{signal.Signals(signum).name} received: saving a checkpoint after this step")

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------------------------
# The loop


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; returns a summary (first/last validation metrics, tokens, FLOPs)."""
    check_config(cfg)
    run, resumed = set_up(cfg)
    cfg = run.cfg  # with the settings the checkpoint or the preset's recipe filled in
    model = run.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ranks = f" x {world_size()} ranks" if world_size() > 1 else ""
    shape = cfg.preset or f"of {cfg.init_from}"
    note(f"model {shape}: {model.num_params(False) / 1e6:.2f}M parameters without embeddings, "
         f"{model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
         f"{run.device.type}{ranks} {str(run.dtype).removeprefix('torch.')} | "
         f"{run.tokens_per_iter:,} tokens/iter")
    start_step, last_loss = run.step, float("nan")
    t_start = t_log = time.time()
    step_at_log = start_step
    model.train()
    with claim_out_dir(run, resumed), StopFlag() as stop:
        while run.step < cfg.max_iters and not stop.agree():
            if run.step % cfg.eval_interval == 0 and not (resumed and run.step == start_step):
                eval_start = time.time()
                validate(run)
                if run.step > start_step:
                    checkpoint(run)
                t_log += time.time() - eval_start  # tokens/s counts training time only

            loss_sum = train_step(run)

            if run.step % cfg.log_interval == 0 or run.step == cfg.max_iters or stop.agree():
                # the mean over ranks; in one process, the only host sync per log interval
                last_loss = run.loss = all_reduce_sum(loss_sum).item() / world_size()
                if not math.isfinite(last_loss):
                    raise UserError(f"loss became {last_loss} at step {run.step}; stopped without saving "
                                    f"(the last good checkpoint is {run.ckpt_path} if any): "
                                    "lower --lr or raise --warmup_iters")
                now = time.time()
                # ETA from the whole run's pace (evaluations included), steadier than the last interval's
                eta = (now - t_start) / (run.step - start_step) * (cfg.max_iters - run.step)
                report_progress(run, last_loss, now - t_log, run.step - step_at_log, eta)
                t_log, step_at_log = now, run.step

        if run.step > start_step or not resumed:  # a resumed run that had already ended adds nothing
            if not stop.stopping:
                validate(run)
            checkpoint(run)
        barrier()  # every rank returns once the checkpoint is on disk (finetune.py reads it next)
    elapsed = time.time() - t_start
    if stop.stopping:
        note(f"stopped at step {run.step}; checkpoint saved to {run.ckpt_path}; continue with --resume")
    else:
        note(f"done: {run.step} steps in {format_duration(elapsed)}; checkpoint {run.ckpt_path}")
    return {"step": run.step, "first_val": run.first_val, "val": run.val, "loss": last_loss,
            "ckpt": str(run.ckpt_path), "tokens": run.earlier_tokens + run.tokens,
            "flops": run.earlier_flops + run.tokens * run.flops_per_token, "interrupted": stop.stopping,
            "seconds": elapsed}


def main(argv: list[str]) -> None:
    train(parse_flags(TrainConfig, argv))


if __name__ == "__main__":
    run_main(main)

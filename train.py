"""Pre-train a decoder LM with cross-entropy or the headless Contrastive Weight Tying objective.

    python train.py                                   # tiny model, built-in Shakespeare, CWT, CPU ok
    python train.py --loss=ce                         # the usual vocabulary head (tied weights)
    python train.py --preset=pythia-70m --dataset=roneneldan/TinyStories --compile

Settings are the fields of `TrainConfig`, overridden by `--key=value` flags or `--config=FILE.json|toml`.
finetune.py and compare.py run this same loop (`train(cfg)`).
"""
from __future__ import annotations

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

from common import (DeviceName, DtypeName, UserError, all_reduce_sum, any_rank, autocast_context, barrier,
                    checkpoint_model, count_ranks, data_parallel, format_duration, gradient_sync,
                    init_distributed, is_main_process, load_checkpoint, main_process_first, parse_flags,
                    peak_flops, pick_device, pick_dtype, rank, run_main, save_checkpoint, world_size)
from data import BatchSampler, ensure_dataset, load_meta, open_split
from eval import evaluate
from loss import LossName, scored_columns, training_loss
from model import GPT, PRESETS, PresetName, build_model, padded_vocab_size


@dataclass
class TrainConfig:
    # data
    dataset: str = "shakespeare"  # a prepared dataset name or folder (see data.py)
    data_root: str = "data"
    # model
    preset: PresetName = "tiny"
    block_size: int | None = None  # context length; default: the preset's (tiny: 256)
    dropout: float = 0.0
    # objective
    loss: LossName = "cwt"
    temperature: float = 1.0
    negatives: Literal["all", "unique"] = "all"  # "unique": distinct target tokens only (not in paper)
    num_negatives: int | None = None  # score against a random subset of k candidates (not in paper)
    # candidates: this rank's micro-batch (paper), or every rank's (global, under torchrun; not in paper)
    negatives_scope: Literal["local", "global"] = "local"
    # optimisation
    batch_size: int = 8  # sequences per micro-batch: CWT's negatives are the other tokens in it
    grad_accum: int = 1  # micro-batches per rank per step (a step takes world_size x grad_accum of them)
    max_iters: int = 600
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 60
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


CKPT_NAME = "ckpt.pt"


def check_config(cfg: TrainConfig) -> None:
    """Reject settings that cannot work, before any time is spent."""
    positive = ["batch_size", "grad_accum", "max_iters", "eval_interval", "eval_batches", "log_interval"]
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ["lr", "temperature"]:
        if not getattr(cfg, name) > 0:
            raise UserError(f"--{name} must be positive, got {getattr(cfg, name)}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise UserError(f"--block_size must be at least 2, got {cfg.block_size}")
    if cfg.num_negatives is not None and cfg.num_negatives < 1:
        raise UserError(f"--num_negatives must be at least 1 (or unset for all), got {cfg.num_negatives}")
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.freeze_body and not (cfg.add_lm_head or cfg.loss == "nce"):
        raise UserError("--freeze_body trains only the LM head; it needs --add_lm_head (or use finetune.py)")


# ----------------------------------------------------------------------------------------------
# Where the weights come from: fresh, our own checkpoint (--resume), or another run's (--init_from)


def choose_model(cfg: TrainConfig, meta: dict, ckpt_path: Path) -> tuple[GPT, dict | None, dict | None]:
    """(model, the checkpoint being resumed or None, the checkpoint started from or None)."""
    if wants_resume(cfg, ckpt_path):
        if not ckpt_path.is_file():
            raise UserError(f"--resume: checkpoint {ckpt_path} not found; pass the interrupted run's --out_dir, "
                            "or start without --resume")
        resumed = load_checkpoint(ckpt_path)
        if resumed.get("train_config", {}).get("init_from", "") != cfg.init_from:
            raise UserError(f"{ckpt_path} was made by a different run (init_from differs); use another --out_dir")
        check_same_tokenizer(meta, resumed, ckpt_path)
        return continued_model(resumed, ckpt_path, cfg), resumed, None
    if cfg.init_from:
        base = load_checkpoint(cfg.init_from)
        check_same_tokenizer(meta, base, cfg.init_from)
        model = continued_model(base, cfg.init_from, cfg)
        if cfg.add_lm_head:
            model.add_lm_head()
        return model, None, base
    block = cfg.block_size or PRESETS[cfg.preset]["block_size"]
    # `nce` needs its own output table (no weight tying)
    model = build_model(cfg.preset, padded_vocab_size(meta["vocab_size"]), block_size=block, dropout=cfg.dropout,
                        lm_head=cfg.loss == "nce")
    return model, None, None


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
    return checkpoint_model(ckpt, path, dropout=cfg.dropout)


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
    first_val: dict | None = None
    val: dict | None = None
    earlier_tokens: int = 0  # tokens and FLOPs of the checkpoints this run started from, so budgets
    earlier_flops: float = 0.0  # and compute add up across stages (pre-training, fine-tune)
    negatives_rng: torch.Generator = dataclasses.field(default_factory=torch.Generator)

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
    model, resumed, base = choose_model(cfg, meta, out_dir / CKPT_NAME)
    if cfg.loss == "nce" and model.lm_head is None:
        raise UserError("--loss=nce needs a separate output table; start it fresh, not from a tied checkpoint")
    if cfg.freeze_body:
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("lm_head.")
    model.to(device)
    block_size = cfg.block_size or model.config.block_size
    vocab_size = model.config.vocab_size
    tokens_per_micro = cfg.batch_size * block_size
    candidates = tokens_per_micro * (world_size() if cfg.negatives_scope == "global" else 1)
    columns = scored_columns(cfg.loss, vocab_size, candidates, cfg.num_negatives)
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
    if base:
        run.earlier_tokens = base.get("base_tokens", 0) + base.get("tokens_seen", 0)
        run.earlier_flops = base.get("base_flops", 0.0) + base.get("flops", 0.0)
    if resumed:
        restore_state(run, resumed)
    return run, resumed


# ----------------------------------------------------------------------------------------------
# Steps, validation, checkpoints, logs


def compute_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
                 negatives_rng: torch.Generator) -> torch.Tensor:
    """The training objective of one micro-batch, from the model's final hidden states."""
    return training_loss(model.hidden(x), y, model.wte.weight, model.output_weight, cfg.loss, cfg.temperature,
                         cfg.negatives, cfg.num_negatives, negatives_rng, cfg.negatives_scope)


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over grad_accum micro-batches; returns the mean loss (still on the device)."""
    cfg, step = run.cfg, run.step
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        index = micro_batch_index(step, micro, cfg.grad_accum)
        x, y = run.sampler.get(index)  # batch i is a function of (seed, i) only
        run.negatives_rng.manual_seed(cfg.seed * 1_000_003 + index)
        torch.manual_seed(cfg.seed * 1_000_033 + index)  # dropout masks too: whichever rank draws batch i
        with gradient_sync(run.loss_fn, sync=micro == cfg.grad_accum - 1):
            with autocast_context(run.device, run.dtype):
                loss = run.loss_fn(x, y, cfg, run.negatives_rng) / cfg.grad_accum
            run.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return loss_sum


def micro_batch_index(step: int, micro: int, grad_accum: int) -> int:
    """Which micro-batch of the data stream this rank trains on. A step takes world_size x grad_accum
    consecutive ones, rank r the r-th run of grad_accum: 2 ranks x grad_accum 1 and 1 process x
    grad_accum 2 see the same batches, so results and checkpoints do not depend on the split."""
    return (step * world_size() + rank()) * grad_accum + micro


def validate(run: Run) -> dict[str, float]:
    """Validation metrics, printed and logged; non-finite ones stop the run before any save."""
    cfg = run.cfg
    val = evaluate(run.model, run.val_tokens, cfg.batch_size, run.block_size, run.device, run.dtype,
                   cfg.eval_batches, contrastive=cfg.loss != "ce", temperature=cfg.temperature)
    if is_main_process():
        print(f"step {run.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in val.items()), file=sys.stderr)
        append_log(run.out_dir, {"step": run.step, "tokens": run.tokens, **val})
    if not math.isfinite(val["val_ce"]):
        raise UserError(f"validation loss became {val['val_ce']} at step {run.step}; stopped without saving "
                        f"(the last good checkpoint is {run.ckpt_path} if any): lower --lr or raise --warmup_iters")
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
        "train_config": dataclasses.asdict(run.cfg), "data_meta": run.meta, "val": run.val,
        "first_val": run.first_val, "tokens_seen": run.tokens, "flops": run.tokens * run.flops_per_token,
        "base_tokens": run.earlier_tokens, "base_flops": run.earlier_flops,
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if run.device.type == "cuda" else None}})


def note(message: str) -> None:
    """A status line on stderr, from rank 0 only."""
    if is_main_process():
        print(message, file=sys.stderr)


def append_log(out_dir: Path, record: dict) -> None:
    with open(out_dir / "log.jsonl", "a") as f:
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
    append_log(run.out_dir, {"step": run.step, "tokens": run.tokens, "loss": loss, "lr": lr, "tokens_per_s": tok_s})


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
    model = run.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ranks = f" x {world_size()} ranks" if world_size() > 1 else ""
    note(f"model {cfg.preset}: {model.num_params(False) / 1e6:.2f}M parameters without embeddings, "
         f"{model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
         f"{run.device.type}{ranks} {str(run.dtype).removeprefix('torch.')} | "
         f"{run.tokens_per_iter:,} tokens/iter")
    run.out_dir.mkdir(parents=True, exist_ok=True)
    if not resumed and is_main_process():  # a fresh run starts a fresh log
        (run.out_dir / "log.jsonl").unlink(missing_ok=True)
    start_step, last_loss = run.step, float("nan")
    t_start = t_log = time.time()
    step_at_log = start_step
    model.train()
    with StopFlag() as stop:
        while run.step < cfg.max_iters and not stop.agree():
            if run.step % cfg.eval_interval == 0 and not (resumed and run.step == start_step):
                eval_start = time.time()
                validate(run)
                if run.step > start_step:
                    checkpoint(run)
                t_log += time.time() - eval_start  # tokens/s counts training time only

            loss_sum = train_step(run)

            if run.step % cfg.log_interval == 0 or run.step == cfg.max_iters or stop.agree():
                last_loss = all_reduce_sum(loss_sum).item() / world_size()  # one process: the only host sync
                if not math.isfinite(last_loss):
                    raise UserError(f"loss became {last_loss} at step {run.step}; stopped without saving (the last "
                                    f"good checkpoint is {run.ckpt_path} if any): lower --lr or raise --warmup_iters")
                now = time.time()
                # ETA from the whole run's pace (evaluations included), steadier than the last interval's
                eta = (now - t_start) / (run.step - start_step) * (cfg.max_iters - run.step)
                report_progress(run, last_loss, now - t_log, run.step - step_at_log, eta)
                t_log, step_at_log = now, run.step

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

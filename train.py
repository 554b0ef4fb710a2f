"""Pre-train a decoder LM with cross-entropy or the headless Contrastive Weight Tying objective.

    python train.py                                   # tiny model, built-in Shakespeare, CWT, CPU ok
    python train.py --loss=ce                         # the usual vocabulary head (tied weights)
    python train.py --preset=pythia-70m --dataset=roneneldan/TinyStories --compile

Settings are the fields of `TrainConfig`, overridden by `--key=value` flags or `--config=FILE.json|toml`.
finetune.py runs this same loop (`train(cfg)`) to add and train an LM head.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch

from data import (BatchSampler, UserError, ensure_dataset, load_meta, open_split, parse_flags, run_main,
                  sequential_batches)
from loss import LossName, contrastive_accuracy, cwt_loss, training_loss
from model import GPT, PRESETS, build_model, model_from_checkpoint, padded_vocab_size


@dataclass
class TrainConfig:
    # data
    dataset: str = "shakespeare"  # a prepared dataset name or folder (see data.py)
    data_root: str = "data"
    # model
    preset: Literal["tiny", "pythia-70m", "gpt2-124m"] = "tiny"
    block_size: Optional[int] = None  # context length; default: the preset's (tiny: 256)
    dropout: float = 0.0
    # objective
    loss: LossName = "cwt"
    temperature: float = 1.0
    negatives: Literal["all", "unique"] = "all"  # "unique": distinct target tokens only (not in paper)
    num_negatives: Optional[int] = None  # score against a random subset of k candidates (not in paper)
    loss_chunk_size: int = 0  # score this many rows at a time: same loss, memory O(chunk x columns); 0 = off
    # optimisation
    batch_size: int = 8  # sequences per micro-batch: CWT's negatives are the other tokens in it
    grad_accum: int = 1
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
    resume: bool = False  # continue from out_dir/ckpt.pt
    # system
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    compile: bool = False
    seed: int = 1337
    # starting from another checkpoint (what finetune.py sets)
    init_from: str = ""  # start from this checkpoint's weights instead of a fresh model
    add_lm_head: bool = False  # give the model an untied LM head initialised from its embeddings
    freeze_body: bool = False  # train only the LM head


CKPT_NAME = "ckpt.pt"


# ----------------------------------------------------------------------------------------------
# Set-up


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
    if cfg.loss_chunk_size < 0:
        raise UserError(f"--loss_chunk_size must be 0 (off) or a number of rows, got {cfg.loss_chunk_size}")
    if cfg.num_negatives is not None and cfg.num_negatives < 1:
        raise UserError(f"--num_negatives must be at least 1 (or unset for all), got {cfg.num_negatives}")
    if not 0 <= cfg.dropout < 1:
        raise UserError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.freeze_body and not (cfg.add_lm_head or cfg.loss == "nce"):
        raise UserError("--freeze_body trains only the LM head; it needs --add_lm_head (or use finetune.py)")


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is visible; use --device=auto or --device=cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 (with loss scaling) on older ones, fp32 on CPU by default."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "float16" and device.type != "cuda":
        raise UserError("--dtype=float16 needs a CUDA GPU; on CPU use --dtype=float32 or bfloat16")
    return getattr(torch, name)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for matmuls; the losses upcast their scores to fp32 themselves."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> dict:
    """A checkpoint dict, with a one-line error for a missing or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one with `python train.py` or pass --ckpt=PATH")
    try:
        # mmap: tensors are read lazily, so looking at a big checkpoint's metadata is cheap
        ckpt = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # a truncated or foreign file: say so without a traceback
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); is it a train.py checkpoint?") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a headless-lm checkpoint (no model weights); pass a train.py checkpoint")
    return ckpt


def load_checkpoint_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[GPT, dict]:
    """`model.load_model` with one-line errors: the model (eval mode, on device) and the checkpoint dict
    (its `data_meta` names the tokenizer, its `train_config` the data and loss)."""
    ckpt = load_checkpoint(path, "cpu")
    return rebuild_model(ckpt, path).to(device).eval(), ckpt


def rebuild_model(ckpt: dict, path: str | Path, **config_overrides) -> GPT:
    """model.model_from_checkpoint, with a one-line error for a checkpoint of other model code."""
    try:
        return model_from_checkpoint(ckpt, **config_overrides)
    except (TypeError, RuntimeError) as e:
        raise UserError(f"{path} does not match this model code: {str(e).strip().splitlines()[0]}") from None


def build_fresh_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """A new model for this config: `nce` needs its own output table (no weight tying)."""
    block = cfg.block_size or PRESETS[cfg.preset]["block_size"]
    return build_model(cfg.preset, padded_vocab_size(vocab_size), block_size=block, dropout=cfg.dropout,
                       lm_head=cfg.loss == "nce")


def model_to_continue(ckpt: dict, path: str | Path, cfg: TrainConfig) -> GPT:
    """The checkpoint's model, to train further with this run's dropout."""
    context = ckpt["model_config"].get("block_size", 0)
    if cfg.block_size is not None and cfg.block_size > context:
        raise UserError(f"--block_size={cfg.block_size} exceeds the checkpoint's context {context}")
    return rebuild_model(ckpt, path, dropout=cfg.dropout)


def check_data_matches(meta: dict, ckpt_meta: dict, where: str) -> None:
    """A model only makes sense on data from the tokenizer it was trained with."""
    if ckpt_meta and ckpt_meta.get("tokenizer") != meta.get("tokenizer"):
        raise UserError(f"{where} was trained with tokenizer {ckpt_meta.get('tokenizer')!r} but the dataset "
                        f"uses {meta.get('tokenizer')!r}; prepare the data with the same --tokenizer")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr (or constant, as the paper's head fine-tune)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def head_columns(cfg: TrainConfig, vocab_size: int, tokens_per_micro_batch: int) -> int:
    """How many output vectors each position is scored against (for the FLOP estimate)."""
    contrastive = min(cfg.num_negatives + 1, tokens_per_micro_batch) if cfg.num_negatives else tokens_per_micro_batch
    return {"ce": vocab_size, "cwt": contrastive, "nce": contrastive, "ce+cwt": vocab_size + contrastive}[cfg.loss]


# Dense bf16 peak FLOP/s, for MFU. Add your GPU here if it is missing.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(gpu_name: str) -> float | None:
    """Match whole words of the name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", gpu_name)), None)


# ----------------------------------------------------------------------------------------------
# Evaluation (also used by eval.py --task=val)


@torch.no_grad()
def evaluate(model: GPT, tokens: np.ndarray, batch_size: int, block_size: int, device: torch.device,
             dtype: torch.dtype = torch.float32, max_batches: int | None = None,
             contrastive: bool = False, temperature: float = 1.0) -> dict[str, float]:
    """Validation metrics on a deterministic sequential pass, comparable across training losses.

    `val_ce` always scores through `model(idx)`: the LM head if any, else the tied input embeddings.
    With `contrastive`, also the contrastive loss (paper definition, in-batch negatives) and its top-1
    accuracy, against the same table as `val_ce` (for CWT that is the input embedding E).
    """
    was_training = model.training
    model.eval()
    total_ce, total_tokens, cwt_sum, acc_sum, n_batches = 0.0, 0, 0.0, 0.0, 0
    for x, y in sequential_batches(tokens, batch_size, block_size, device, max_batches):
        with autocast_context(device, dtype):
            h = model.hidden(x)
            logits = (h @ model.output_weight.T).float()
            total_ce += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            if contrastive:
                e = model.output_weight[y]  # the tied E, or the nce ablation's own output table
                cwt_sum += cwt_loss(h, e, temperature).item()
                acc_sum += contrastive_accuracy(h, e, y).item()
        total_tokens += y.numel()
        n_batches += 1
    model.train(was_training)
    if n_batches == 0:
        raise UserError("the validation split is shorter than one block; use a smaller --block_size")
    val_ce = total_ce / total_tokens
    metrics = {"val_ce": val_ce, "val_ppl": math.exp(min(val_ce, 700.0))}
    if contrastive:
        metrics.update(val_cwt=cwt_sum / n_batches, val_acc=acc_sum / n_batches)
    return metrics


# ----------------------------------------------------------------------------------------------
# Checkpoints and logs


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write to a temp file, then rename: a crash mid-save never leaves a truncated checkpoint."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name says the checkpoint is complete
    os.replace(tmp, path)


def append_log(out_dir: Path, record: dict) -> None:
    with open(out_dir / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class StopFlag:
    """SIGINT/SIGTERM ask the loop to stop after the current step, save, and exit cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop right away
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint after this step", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------------------------
# The loop


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; returns a summary (first/last validation metrics, tokens, FLOPs)."""
    check_config(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left

    data_dir = ensure_dataset(cfg.dataset, cfg.data_root)
    meta = load_meta(data_dir)
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / CKPT_NAME

    # Where the weights come from: our own checkpoint (resume), another run's (fine-tune), or fresh.
    if cfg.resume and not ckpt_path.is_file():
        raise UserError(f"--resume: checkpoint {ckpt_path} not found; pass the interrupted run's --out_dir, "
                        "or start without --resume")
    resumed = load_checkpoint(ckpt_path, "cpu") if cfg.resume else None
    if cfg.resume and resumed.get("train_config", {}).get("init_from", "") != cfg.init_from:
        raise UserError(f"{ckpt_path} was made by a different run (init_from differs); use another --out_dir")
    base = load_checkpoint(cfg.init_from, "cpu") if cfg.init_from and not resumed else None
    if resumed or base:
        check_data_matches(meta, (resumed or base).get("data_meta", {}), str(ckpt_path if resumed else cfg.init_from))
    if resumed:
        model = model_to_continue(resumed, ckpt_path, cfg)
    elif base:
        model = model_to_continue(base, cfg.init_from, cfg)
        if cfg.add_lm_head:
            model.add_lm_head()
    else:
        model = build_fresh_model(cfg, meta["vocab_size"])
    block_size = cfg.block_size or model.config.block_size
    if cfg.loss == "nce" and model.lm_head is None:
        raise UserError("--loss=nce needs a separate output table; start it fresh, not from a tied checkpoint")
    if cfg.freeze_body:
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("lm_head.")
    model.to(device)

    train_tokens = open_split(data_dir, "train", model.config.vocab_size)
    val_tokens = open_split(data_dir, "val", model.config.vocab_size)
    sampler = BatchSampler(train_tokens, cfg.batch_size, block_size, cfg.seed, device)

    optimizer = model.configure_optimizer(cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    lineage = {"base_tokens": 0, "base_flops": 0.0}
    if base:  # what it took to make the starting point, so budgets and compute add up across stages
        lineage = {"base_tokens": base.get("base_tokens", 0) + base.get("tokens_seen", 0),
                   "base_flops": base.get("base_flops", 0.0) + base.get("flops", 0.0)}
    start_step = 0
    if resumed:
        try:
            optimizer.load_state_dict(resumed["optimizer"])
        except (KeyError, ValueError):
            raise UserError(f"{ckpt_path} holds the optimizer of other trainable parameters; resume with the "
                            "interrupted run's settings (--freeze_body, --loss)") from None
        if scaler.is_enabled() and resumed.get("scaler"):  # fp16 before and now: keep its loss scale
            scaler.load_state_dict(resumed["scaler"])
        start_step = resumed["step"]
        lineage = {k: resumed[k] for k in lineage}
        torch.set_rng_state(resumed["rng"]["torch"])
        if device.type == "cuda" and resumed["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(resumed["rng"]["cuda"])

    tokens_per_micro = cfg.batch_size * block_size
    tokens_per_iter = tokens_per_micro * cfg.grad_accum
    flops_per_token = model.flops_per_token(block_size, head_columns(cfg, model.config.vocab_size, tokens_per_micro))
    peak = peak_flops(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model {cfg.preset}: {model.num_params(False) / 1e6:.2f}M parameters without embeddings, "
          f"{model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
          f"{device.type} {str(dtype).removeprefix('torch.')} | {tokens_per_iter:,} tokens/iter", file=sys.stderr)

    embedding = model.wte.weight
    contrastive = cfg.loss != "ce"
    negatives_rng = torch.Generator()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return training_loss(model.hidden(x), y, embedding, model.output_weight, cfg.loss, cfg.temperature,
                             cfg.negatives, cfg.num_negatives, negatives_rng, cfg.loss_chunk_size or None)

    step_loss = torch.compile(loss_of) if cfg.compile else loss_of

    def validate(step: int) -> dict[str, float]:
        """Validation metrics, printed and logged; non-finite ones stop the run before any save."""
        val = evaluate(model, val_tokens, cfg.batch_size, block_size, device, dtype, cfg.eval_batches,
                       contrastive, cfg.temperature)
        print(f"step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in val.items()), file=sys.stderr)
        append_log(out_dir, {"step": step, "tokens": step * tokens_per_iter, **val})
        if not math.isfinite(val["val_ce"]):
            raise UserError(f"validation loss became {val['val_ce']} at step {step}; stopped without saving "
                            f"(the last good checkpoint is {ckpt_path} if any): lower --lr or raise --warmup_iters")
        return val

    def checkpoint(step: int, val: dict | None, first_val: dict | None) -> dict:
        return {"first_val": first_val, "model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step,
                "train_config": dataclasses.asdict(cfg), "data_meta": meta, "val": val,
                "tokens_seen": step * tokens_per_iter, "flops": step * tokens_per_iter * flops_per_token,
                **lineage, "rng": {"torch": torch.get_rng_state(),
                                   "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}}

    out_dir.mkdir(parents=True, exist_ok=True)
    if not resumed:  # a fresh run starts a fresh log
        (out_dir / "log.jsonl").unlink(missing_ok=True)
    first_val = resumed.get("first_val") if resumed else None
    val = resumed.get("val") if resumed else None
    step, last_loss = start_step, float("nan")
    t_start, t_log, step_at_log = time.time(), time.time(), start_step
    model.train()
    with StopFlag() as stop:
        while step < cfg.max_iters and not stop.requested:
            if step % cfg.eval_interval == 0 and not (resumed and step == start_step):
                eval_start = time.time()
                val = validate(step)
                first_val = first_val or val
                if step > start_step:
                    save_checkpoint(ckpt_path, checkpoint(step, val, first_val))
                t_log += time.time() - eval_start  # tokens/s counts training time only

            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = sampler.get(step * cfg.grad_accum + micro)
                negatives_rng.manual_seed(cfg.seed * 1_000_003 + step * cfg.grad_accum + micro)
                with autocast_context(device, dtype):
                    loss = step_loss(x, y) / cfg.grad_accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_interval == 0 or step == cfg.max_iters or stop.requested:
                last_loss = loss_sum.item()  # the only host sync per log interval
                if not math.isfinite(last_loss):
                    raise UserError(f"loss became {last_loss} at step {step}; stopped without saving (the last "
                                    f"good checkpoint is {ckpt_path} if any): lower --lr or raise --warmup_iters")
                now = time.time()
                tok_s = (step - step_at_log) * tokens_per_iter / max(now - t_log, 1e-9)
                # ETA from the whole run's pace (evaluations included), steadier than the last interval's
                eta = (now - t_start) / (step - start_step) * (cfg.max_iters - step)
                mfu = f" | MFU {100 * tok_s * flops_per_token / peak:.1f}%" if peak else ""
                print(f"step {step}/{cfg.max_iters} | loss {last_loss:.4f} | lr {lr:.2e} | "
                      f"{tok_s:,.0f} tok/s | ETA {format_duration(eta)}{mfu}", file=sys.stderr)
                append_log(out_dir, {"step": step, "tokens": step * tokens_per_iter, "loss": last_loss,
                                     "lr": lr, "tokens_per_s": tok_s})
                t_log, step_at_log = now, step

        if not stop.requested:
            val = validate(step)
            first_val = first_val or val
        save_checkpoint(ckpt_path, checkpoint(step, val, first_val))
    elapsed = time.time() - t_start
    if stop.requested:
        print(f"stopped at step {step}; checkpoint saved to {ckpt_path}; continue with --resume", file=sys.stderr)
    else:
        print(f"done: {step} steps in {format_duration(elapsed)}; checkpoint {ckpt_path}", file=sys.stderr)
    return {"step": step, "first_val": first_val, "val": val, "loss": last_loss, "ckpt": str(ckpt_path),
            "tokens": lineage["base_tokens"] + step * tokens_per_iter,
            "flops": lineage["base_flops"] + step * tokens_per_iter * flops_per_token,
            "interrupted": stop.requested, "seconds": elapsed}


def main(argv: list[str]) -> None:
    train(parse_flags(TrainConfig, argv))


if __name__ == "__main__":
    run_main(main)

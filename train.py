"""Pre-train a language model headless, with Contrastive Weight Tying (CWT), or with cross-entropy.

    python train.py                                   # tiny model, built-in Shakespeare, CWT: CPU ok
    python train.py --loss=ce --out_dir=out-ce        # the usual vocabulary head (tied to E)
    python train.py --preset=pythia-70m --dataset=tinystories --compile     # the paper's decoder, a GPU
    torchrun --standalone --nproc_per_node=8 train.py ...                   # several GPUs

Settings are TrainConfig's fields, as --key=value flags or --config=FILE.json|toml (--help lists them).
Top to bottom: settings, where the weights come from, the objective and validation, logs, the loop.
finetune.py and compare.py run the same loop through train(cfg).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from common import (
    DeviceName,
    DtypeName,
    StopFlag,
    UserError,
    all_reduce_sum,
    append_log,
    autocast_context,
    barrier,
    claim_out_dir,
    in_range,
    init_distributed,
    is_main_process,
    last_good_checkpoint,
    need_extra,
    note,
    parse_flags,
    pick_device,
    pick_dtype,
    rank,
    run_main,
    save_checkpoint,
    world_size,
)
from data import BatchSampler, dataset_tokenizer, ensure_dataset, load_meta, open_split, sequential_batches
from loss import LossName, masked_rows, scored_columns, training_loss, validation_sums
from model import GPT, PresetName


@dataclass
class TrainConfig:
    # data and model
    dataset: str = "shakespeare"  # a prepared dataset name or folder (see data.py); A,B,C: a mix (mixing.py)
    data_root: str = "data"
    mix_alpha: float = 0.3  # a mix draws each micro-batch's source with p ~ tokens^alpha (XLM-R's 0.3)
    preset: PresetName | None = None  # model shape; default: tiny, or the checkpoint's when starting from one
    block_size: int | None = None  # context length; default: the preset's
    dropout: float = 0.0
    # objective
    objective: Literal["causal", "mlm"] = "causal"  # mlm: BERT masking, bidirectional attention (masking.py)
    loss: LossName = "cwt"
    temperature: float = 1.0
    untied_head: bool = False  # ce: a separate output matrix, as Pythia's config (the paper's CE ties it)
    loss_chunk_size: int = 0  # score this many rows at a time: same loss, memory O(chunk x columns) (chunked.py)
    negatives: Literal["all", "unique"] = "all"  # unique: each distinct target token once (negatives.py)
    num_negatives: int | None = None  # score a random subset of k candidates (negatives.py)
    negatives_scope: Literal["local", "global"] = "local"  # global: every rank's micro-batch (negatives.py)
    # optimisation
    batch_size: int = 8  # sequences per micro-batch (per rank): CWT's negatives are the other tokens in it
    grad_accum: int = 1  # micro-batches per rank per step
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
    # validation, logs and checkpoints
    eval_interval: int = 100  # steps between validations, each followed by a checkpoint
    eval_batches: int = 20
    log_interval: int = 10
    out_dir: str = "out"
    resume: bool | Literal["auto"] = False  # continue out_dir/ckpt.pt; auto: if there is one, else start
    overwrite: bool = False  # start over in an out_dir that holds another run
    # system
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    compile: bool = False
    seed: int = 1337
    # starting from another checkpoint's weights (finetune.py sets these)
    init_from: str = ""  # a checkpoint path, or hf:ORG/NAME / hf:FOLDER (hf.py)
    add_lm_head: bool = False  # an untied LM head initialised from the input embeddings
    freeze_body: bool = False  # train only the LM head


# The paper's schedule for the Pythia shapes: cosine to 0 after a 1% warmup (1430 of 143,000 steps); lr,
# betas, decay and clip are TrainConfig's defaults. Short CPU runs warm up over 10% and end at lr / 10.
RECIPES = {"pythia-70m": dict(warmup=0.01, final_lr=0.0), "pythia-160m": dict(warmup=0.01, final_lr=0.0)}
DEFAULT_RECIPE = dict(warmup=0.1, final_lr=0.1)


def check_config(cfg: TrainConfig) -> None:
    """Refuse settings that cannot work, before any time is spent."""
    for name in ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_batches", "log_interval",
                 "num_negatives"):
        in_range(cfg, name, 1)
    for name in ("warmup_iters", "weight_decay", "grad_clip", "loss_chunk_size"):
        in_range(cfg, name, 0)
    for name in ("dropout", "beta1", "beta2"):
        in_range(cfg, name, 0, 1, "[)")
    in_range(cfg, "block_size", 2)
    in_range(cfg, "lr", 0, ends="(]")
    in_range(cfg, "min_lr", 0, cfg.lr)
    in_range(cfg, "eps", 0, ends="(]")
    in_range(cfg, "temperature", 1e-3, 1e3)  # beyond, fp32 scores overflow or every softmax is uniform
    in_range(cfg, "mix_alpha", 0, ends="(]")
    if "," in cfg.dataset:
        need_extra("mixing", "--dataset=A,B,...")
    if cfg.loss_chunk_size:
        need_extra("chunked", "--loss_chunk_size")
    if cfg.negatives != "all" or cfg.num_negatives is not None or cfg.negatives_scope != "local":
        need_extra("negatives", "--negatives, --num_negatives or --negatives_scope")
    if cfg.objective == "mlm":
        need_extra("masking", "--objective=mlm")
    if cfg.objective == "mlm" and cfg.negatives_scope == "global":
        raise UserError("--negatives_scope=global gathers equal-sized micro-batches, but an MLM's masked "
                        "positions differ per rank: use --negatives_scope=local with --objective=mlm")
    if cfg.untied_head and cfg.loss not in ("ce", "ce+cwt"):
        raise UserError(f"--untied_head gives cross-entropy its own output matrix; --loss={cfg.loss} has none")
    if cfg.freeze_body and not (cfg.add_lm_head or cfg.loss == "nce"):
        raise UserError("--freeze_body trains only the LM head; it needs --add_lm_head (or use finetune.py)")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr (or constant, as the paper's text has the fine-tune)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


# The objective, and validation


class Objective(torch.nn.Module):
    """The model and its loss as one module: DDP averages the gradients of what runs through its forward
    (hidden states, then the loss against the embeddings), and torch.compile fuses both."""

    def __init__(self, model: GPT, cfg: TrainConfig):
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        cfg, h = self.cfg, self.model.hidden(x)
        if cfg.objective == "mlm":  # the masked positions only: no MLM transform head, the model is headless
            h, y = masked_rows(h, y)
        return training_loss(h, y, self.model.wte.weight, self.model.output_weight, cfg.loss, cfg.temperature,
                             cfg.negatives, cfg.num_negatives, generator, cfg.loss_chunk_size or None,
                             cfg.negatives_scope)


def contrastive_table(model: GPT, loss: str, encoder: bool = False) -> torch.Tensor | None:
    """What the contrastive metrics score against: E (cwt, ce+cwt), the output table (nce); for ce none,
    but encoders report them for every objective (against the tied E), as the paper's tables do."""
    table = {"ce": None, "nce": model.output_weight}.get(loss, model.wte.weight)
    return model.output_weight if table is None and encoder else table


def evaluate(model: GPT, tokens, batch_size: int, block_size: int, device: torch.device,
             dtype: torch.dtype = torch.float32, max_batches: int | None = None,
             contrastive: torch.Tensor | None = None, temperature: float = 1.0, chunk_size: int | None = None,
             mask: Any = None, token_bytes: torch.Tensor | None = None) -> dict[str, float]:
    """Validation on the split's first batches (loss.validation_sums): val_ce, and given a contrastive table
    val_cwt and val_acc, and given each id's UTF-8 bytes val_bpb. An encoder (`mask`: a masking.Masking) is
    scored on fixed masks, over its masked positions. Each rank scores every world_size-th batch."""
    was_training, sums = model.training, torch.zeros(7, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for i, x, y in sequential_batches(tokens, batch_size, block_size, device, max_batches, rank(), world_size()):
            x, y = mask.validation_batch(x, i) if mask else (x, y)
            with autocast_context(device, dtype):
                h, y = masked_rows(model.hidden(x), y) if mask else (model.hidden(x), y)
                sums += torch.cat([validation_sums(h, y, model.output_weight, contrastive, temperature, chunk_size,
                                                   token_bytes), torch.ones(1, dtype=torch.float64, device=device)])
    model.train(was_training)
    ce, n, cwt, acc, special_ce, n_bytes, batches = all_reduce_sum(sums).tolist()
    if batches == 0:
        raise UserError("the validation split is shorter than one block; use a smaller --block_size")
    metrics = {"val_ce": ce / n, "val_ppl": math.exp(min(ce / n, 700.0))}
    if contrastive is not None:
        metrics.update(val_cwt=cwt / batches, val_acc=acc / batches)
    if token_bytes is not None:
        metrics["val_bpb"] = (ce - special_ce) / math.log(2) / max(n_bytes, 1)
    return metrics


# The loop


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; returns a summary (first and last validation, tokens, FLOPs)."""
    check_config(cfg)
    device = init_distributed(pick_device(cfg.device))  # under torchrun, this rank's GPU
    dtype = pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left
    prepared = lambda: [ensure_dataset(name, cfg.data_root) for name in cfg.dataset.split(",")]  # noqa: E731
    data_dirs = prepared() if is_main_process() else None
    barrier()  # rank 0 prepares the built-in data; the others then read it
    data_dirs = data_dirs or prepared()
    data_dir, out_dir = data_dirs[0], Path(cfg.out_dir)
    meta = load_meta(data_dir)
    tokenizer_json = (data_dir / "tokenizer.json").read_text() if (data_dir / "tokenizer.json").is_file() else None
    from finetune import starting_point  # fresh, --resume or --init_from (there: finetune.py imports this file)

    cfg, model, resumed, state = starting_point(cfg, meta, out_dir / "ckpt.pt", device)
    for name, p in model.named_parameters():
        p.requires_grad = not cfg.freeze_body or name.startswith("lm_head.")
    model.to(device)
    block, vocab = cfg.block_size or model.config.block_size, model.config.vocab_size
    optimizer = model.configure_optimizer(cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if resumed:  # continue exactly: the optimizer, the fp16 loss scale and the random state
        try:
            optimizer.load_state_dict(resumed["optimizer"])
        except (KeyError, ValueError):
            raise UserError(f"{out_dir / 'ckpt.pt'} holds the optimizer of other trainable parameters; resume with "
                            "the interrupted run's settings (--freeze_body, --loss)") from None
        if scaler.is_enabled() and resumed.get("scaler"):
            scaler.load_state_dict(resumed["scaler"])
        torch.set_rng_state(resumed["rng"]["torch"])
        if device.type == "cuda" and resumed["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(resumed["rng"]["cuda"])
    mask = None
    if cfg.objective == "mlm":
        from masking import Masking  # BERT masking of every batch, validation on fixed masks

        mask = Masking(meta, cfg.seed)
    objective = Objective(model, cfg)
    if cfg.compile:
        objective.compile()
    if world_size() > 1:  # rank 0's weights to every rank; gradients averaged over ranks in backward
        objective = torch.nn.parallel.DistributedDataParallel(objective, gradient_as_bucket_view=True)
    sampler = BatchSampler(open_split(data_dir, "train", vocab), cfg.batch_size, block, cfg.seed, device)
    if len(data_dirs) > 1:
        from mixing import MixedSampler  # micro-batch i from a source drawn by (seed, i), p ~ tokens^mix_alpha

        sampler = MixedSampler(data_dirs, cfg, block, vocab, device)
        note(sampler.describe())
    val_splits = {d.name: open_split(d, "val", vocab) for d in data_dirs}
    micro_per_step = cfg.grad_accum * world_size()
    tokens_per_step = micro_per_step * cfg.batch_size * block
    scored = mask.rate if mask else 1.0  # an encoder scores its masked positions only
    candidates = round(scored * cfg.batch_size * block * (world_size() if cfg.negatives_scope == "global" else 1))
    flops_per_token = model.flops_per_token(block, scored * scored_columns(cfg.loss, vocab, candidates,
                                                                          cfg.num_negatives))
    if cfg.num_negatives is not None and cfg.loss != "ce" and is_main_process():
        from negatives import warn_if_every_negative

        warn_if_every_negative(cfg.num_negatives, candidates)
    table = contrastive_table(model, cfg.loss, encoder=mask is not None)
    token_bytes = None if mask else torch.tensor(token_byte_lengths(dataset_tokenizer(data_dir)), device=device)
    peak = peak_flops(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    note(f"model {cfg.preset or 'of ' + cfg.init_from}: {model.num_params(False) / 1e6:.2f}M parameters without "
         f"embeddings, {model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
         f"{device.type}{f' x {world_size()} ranks' if world_size() > 1 else ''} "
         f"{str(dtype).removeprefix('torch.')} | {tokens_per_step:,} tokens/step")

    def validate() -> None:  # printed and logged; a non-finite metric stops the run before any save
        per_source = {name: evaluate(model, tokens, cfg.batch_size, block, device, dtype, cfg.eval_batches, table,
                                     cfg.temperature, cfg.loss_chunk_size or None, mask, token_bytes)
                      for name, tokens in val_splits.items()}
        val = sampler.combine(per_source) if len(per_source) > 1 else per_source.popitem()[1]
        if not math.isfinite(val["val_ce"]):
            raise UserError(f"validation loss became {val['val_ce']} at step {state.step}; stopped without saving "
                            f"({last_good_checkpoint(out_dir / 'ckpt.pt')}): lower --lr or raise --warmup_iters")
        note(f"step {state.step}: " + " | ".join(f"{k} {v:.4f}" if abs(v) < 1e6 else f"{k} {v:.4g}"
                                                 for k, v in val.items()))
        if is_main_process():
            append_log(out_dir, {"step": state.step, "tokens": state.tokens, **val})
        state.val, state.first_val = val, state.first_val or val

    def save() -> None:  # all it takes to continue exactly, and what it took to get here
        if is_main_process():
            with stop.deferred():
                save_checkpoint(out_dir / "ckpt.pt", {
                    "model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "loss": state.loss,
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": state.step,
                    "state": dataclasses.asdict(state), "train_config": dataclasses.asdict(cfg), "data_meta": meta,
                    "val": state.val, "first_val": state.first_val, "tokens_seen": state.tokens, "flops": state.flops,
                    "base_tokens": state.earlier_tokens, "base_flops": state.earlier_flops,
                    "mask_spec": dataclasses.asdict(mask.spec) if mask else None, "tokenizer_json": tokenizer_json,
                    "mix": dict(zip(sampler.names, sampler.probabilities)) if len(data_dirs) > 1 else None,
                    "rng": {"torch": torch.get_rng_state(),
                            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}})

    start_step, stopping, negatives_rng = state.step, False, torch.Generator()
    t_start = t_log = time.time()
    step_at_log = start_step
    model.train()
    with claim_out_dir(out_dir, resumed and resumed["step"], cfg.overwrite, cfg.resume == "auto"), StopFlag() as stop:
        while state.step < cfg.max_iters and not stopping:
            if state.step % cfg.eval_interval == 0 and not (resumed and state.step == start_step):
                eval_start = time.time()
                validate()
                if state.step > start_step:
                    save()
                t_log += time.time() - eval_start  # tokens/s counts training time only

            for group in optimizer.param_groups:
                group["lr"] = lr_at(state.step, cfg)
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                # Micro-batch i of the stream is a function of (seed, i) alone, whoever draws it: a step takes
                # world_size x grad_accum consecutive ones, rank r the r-th run of grad_accum.
                index = state.micro_batches + rank() * cfg.grad_accum + micro
                x, y = sampler.get(index)
                x, y = mask.training_batch(x, index) if mask else (x, y)
                negatives_rng.manual_seed(cfg.seed * 1_000_003 + index)
                torch.manual_seed(cfg.seed * 1_000_033 + index)  # dropout masks too
                last = micro == cfg.grad_accum - 1  # DDP all-reduces the gradients once, after the last one
                with objective.no_sync() if world_size() > 1 and not last else contextlib.nullcontext():
                    with autocast_context(device, dtype):
                        loss = objective(x, y, negatives_rng) / cfg.grad_accum
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            optimizer_step(optimizer, model.parameters(), cfg.grad_clip, scaler)
            state.step, state.micro_batches = state.step + 1, state.micro_batches + micro_per_step
            state.tokens, state.flops = state.tokens + tokens_per_step, state.flops + tokens_per_step * flops_per_token

            if state.step % cfg.log_interval == 0 or state.step == cfg.max_iters:
                # one all-reduce per log interval: the mean loss over ranks, and whether any rank must stop
                totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(stop.requested), device=device)]))
                state.loss, stopping = totals[0].item() / world_size(), totals[1].item() > 0
                if not math.isfinite(state.loss):
                    raise UserError(f"loss became {state.loss} at step {state.step}; stopped without saving ("
                                    f"{last_good_checkpoint(out_dir / 'ckpt.pt')}): lower --lr or raise --warmup_iters")
                now, lr = time.time(), lr_at(state.step - 1, cfg)
                tok_s = (state.step - step_at_log) * tokens_per_step / max(now - t_log, 1e-9)
                eta = int((now - t_start) / (state.step - start_step) * (cfg.max_iters - state.step))
                mfu = f" | MFU {100 * tok_s / world_size() * flops_per_token / peak:.1f}%" if peak else ""
                note(f"step {state.step}/{cfg.max_iters} | loss {state.loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
                     f"ETA {eta // 3600}h{eta % 3600 // 60:02d}m{eta % 60:02d}s{mfu}")
                if is_main_process():
                    append_log(out_dir, {"step": state.step, "tokens": state.tokens, "loss": state.loss, "lr": lr,
                                         "tokens_per_s": tok_s})
                t_log, step_at_log = now, state.step
            stopping = stopping or (world_size() == 1 and stop.requested)  # one process: nothing to agree

        if state.step > start_step or not resumed:  # a resumed run that had already ended adds nothing
            if not stopping:
                validate()
            save()
        barrier()  # every rank returns once the checkpoint is on disk (finetune.py reads it next)
    elapsed = time.time() - t_start
    note(f"stopped at step {state.step}; checkpoint saved to {out_dir / 'ckpt.pt'}; continue with --resume"
         if stopping else f"done: {state.step} steps in {elapsed:.0f} s; checkpoint {out_dir / 'ckpt.pt'}")
    return {"step": state.step, "first_val": state.first_val, "val": state.val, "loss": state.loss,
            "ckpt": str(out_dir / "ckpt.pt"), "tokens": state.earlier_tokens + state.tokens,
            "flops": state.earlier_flops + state.flops, "interrupted": stopping, "seconds": elapsed}


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}  # dense bf16 FLOP/s, for MFU


def peak_flops(device: torch.device) -> float | None:
    """A GPU's peak, matched on whole words of its name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", name)), None)


def token_byte_lengths(enc: Any) -> list[int]:
    """The UTF-8 bytes each id stands for (0 for special tokens), for bits per byte."""
    if hasattr(enc, "token_byte_lengths"):
        return enc.token_byte_lengths()
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    return [0 if i in special else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]


def optimizer_step(optimizer: torch.optim.Optimizer, parameters: Any, grad_clip: float = 1.0,
                   scaler: torch.amp.GradScaler | None = None) -> None:
    """Clip the gradient norm (0: off), step, reset the gradients; with an fp16 GradScaler, unscale first and
    skip a step whose gradients overflowed."""
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str]) -> None:
    train(parse_flags(TrainConfig, argv))


if __name__ == "__main__":
    run_main(main)

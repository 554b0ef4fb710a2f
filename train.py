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
import json
import math
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from common import (DeviceName, DtypeName, UserError, all_reduce_sum, atomic_file, autocast_context, barrier,
                    checkpoint_model, hold_lock, in_range, init_distributed, is_main_process, last_good_checkpoint,
                    load_checkpoint, need_extra, parse_flags, pick_device, pick_dtype, rank, remove_stale_temps,
                    run_main, save_checkpoint, world_size)
from data import (BatchSampler, dataset_tokenizer, ensure_dataset, load_meta, open_split, sequential_batches,
                  token_byte_lengths)
from loss import LossName, contrastive_accuracy, ce_loss, cwt_loss, masked_rows, scored_columns, training_loss
from model import GPT, PRESETS, PresetName, build_model, padded_vocab_size


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
# What makes a resumed run the same experiment; anything else may change (--max_iters extends it).
RESUME_SAME = ("objective", "loss", "dataset", "batch_size", "block_size", "negatives", "negatives_scope",
               "init_from")
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}  # dense bf16 FLOP/s, for MFU


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


# ----------------------------------------------------------------------------------------------
# Where the weights come from: fresh, this run's checkpoint (--resume), or another's (--init_from)


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


def starting_point(cfg: TrainConfig, meta: dict, ckpt_path: Path) -> tuple[TrainConfig, GPT, dict | None, State]:
    """(the settings, unset ones filled in; the model; the checkpoint resumed, if any; the state)."""
    resuming = ckpt_path.is_file() if cfg.resume == "auto" else cfg.resume
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


# ----------------------------------------------------------------------------------------------
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


@torch.no_grad()
def evaluate(model: GPT, tokens, batch_size: int, block_size: int, device: torch.device,
             dtype: torch.dtype = torch.float32, max_batches: int | None = None,
             contrastive: torch.Tensor | None = None, temperature: float = 1.0, chunk_size: int | None = None,
             mask: Any = None, token_bytes: torch.Tensor | None = None) -> dict[str, float]:
    """Validation on the split's first batches, comparable across losses: val_ce scores through the LM head
    or the tied E, as model(idx) does; given a contrastive table, also the CWT loss (in-batch negatives)
    and its top-1 accuracy; in chunks when the run's loss is. Given each id's UTF-8 bytes, bits per byte:
    comparable across tokenizers (special tokens count neither bits nor bytes). An encoder (`mask`, a
    masking.Masking) is scored on fixed masks. Each rank scores every world_size-th batch; the sums add up."""
    was_training, sums = model.training, torch.zeros(7, dtype=torch.float64, device=device)
    model.eval()
    for i, x, y in sequential_batches(tokens, batch_size, block_size, device, max_batches, rank(), world_size()):
        x, y = mask.validation_batch(x, i) if mask else (x, y)
        with autocast_context(device, dtype):
            h, y = masked_rows(model.hidden(x), y) if mask else (model.hidden(x), y)
            h, y = h.reshape(-1, h.size(-1)), y.reshape(-1)
            sums[0] += ce_loss(h, model.output_weight, y, chunk_size).double() * y.numel()
            if contrastive is not None:
                sums[2] += cwt_loss(h, contrastive[y], temperature, chunk_size).double()
                sums[3] += contrastive_accuracy(h, contrastive[y], y, chunk_size).double()
            if token_bytes is not None and (special := token_bytes[y] == 0).any():
                sums[5] += ce_loss(h[special], model.output_weight, y[special]).double() * special.sum()
        sums[1] += y.numel()
        sums[4] += 1
        sums[6] += token_bytes[y].sum() if token_bytes is not None else 0
    model.train(was_training)
    ce_sum, n_tokens, cwt_sum, acc_sum, n_batches, special_ce, n_bytes = all_reduce_sum(sums).tolist()
    if n_batches == 0:
        raise UserError("the validation split is shorter than one block; use a smaller --block_size")
    metrics = {"val_ce": ce_sum / n_tokens, "val_ppl": math.exp(min(ce_sum / n_tokens, 700.0))}
    if contrastive is not None:
        metrics.update(val_cwt=cwt_sum / n_batches, val_acc=acc_sum / n_batches)
    if token_bytes is not None:
        metrics["val_bpb"] = (ce_sum - special_ce) / math.log(2) / max(n_bytes, 1)
    return metrics


# ----------------------------------------------------------------------------------------------
# Logs, and the run's hold on out_dir (rank 0 alone writes: every rank holds the same weights)


@contextlib.contextmanager
def claim_out_dir(out_dir: Path, cfg: TrainConfig, resumed: dict | None) -> Iterator[None]:
    """out_dir for this run alone while it runs. A new run never replaces another's checkpoint or log (but
    with --overwrite); a resumed one keeps the log up to its checkpoint, so it reads as one run."""
    if not is_main_process():
        yield
        return
    log, ckpt = out_dir / "log.jsonl", out_dir / "ckpt.pt"
    if any(p.exists() and not p.is_dir() for p in (out_dir, *out_dir.parents)):
        raise UserError(f"--out_dir={out_dir}: it or a folder above it is a file; pass a folder")
    if not resumed and not cfg.overwrite and (ckpt.exists() or (log.exists() and cfg.resume != "auto")):
        raise UserError(f"{out_dir} holds another run ({'ckpt.pt' if ckpt.exists() else 'log.jsonl'}); continue "
                        "it with --resume, start over with --overwrite, or pick another --out_dir")
    with hold_lock(out_dir, "training run"):
        remove_stale_temps(out_dir)
        if resumed and log.is_file():  # a line cut short by a crash does not end in "}": dropped
            kept = [line + "\n" for line in log.read_text().splitlines()
                    if line.endswith("}") and json.loads(line).get("step", 0) <= resumed["step"]]
            with atomic_file(log, "w") as f:
                f.writelines(kept)
        elif not resumed:
            log.unlink(missing_ok=True)
        yield


def append_log(out_dir: Path, record: dict) -> None:
    record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    try:  # valid JSON always: a null, never NaN or Infinity
        with open(out_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise UserError(f"cannot append to {out_dir / 'log.jsonl'} ({e.strerror}); free some space or fix the "
                        "folder, then continue with --resume") from None


def note(message: str) -> None:
    """A status line on stderr, from rank 0 only."""
    if is_main_process():
        print(message, file=sys.stderr)


class StopFlag:
    """Ctrl-C or SIGTERM: the loop stops at the next agreed step, saves and exits. A second one stops at
    once, but never in the middle of a save: it waits for the save to end."""

    def __enter__(self):
        self.requested, self.saving, self.pending = False, False, False
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        if self.requested and not self.saving:
            raise KeyboardInterrupt
        self.pending, self.requested = self.requested, True  # a second one during a save: once it is done
        if not self.pending:
            note(f"\n{signal.Signals(signum).name} received: saving a checkpoint")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------
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
    cfg, model, resumed, state = starting_point(cfg, meta, out_dir / "ckpt.pt")
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
    with claim_out_dir(out_dir, cfg, resumed), StopFlag() as stop:
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


def peak_flops(device: torch.device) -> float | None:
    """A GPU's peak, matched on whole words of its name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", name)), None)


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

"""Pre-train a language model headless, with Contrastive Weight Tying (CWT), or with cross-entropy.

    python train.py                                   # tiny model, built-in Shakespeare, CWT: CPU ok
    python train.py --loss=ce --out_dir=out-ce        # the usual vocabulary head (tied to E)
    python train.py --preset=pythia-70m --dataset=tinystories --compile     # the paper's decoder, a GPU
    torchrun --standalone --nproc_per_node=8 train.py ...                   # several GPUs

The training story, top to bottom: the settings (TrainConfig: --key=value flags or --config=FILE; --help), the
objective, validation, the run, the loop (train(), which finetune.py and compare.py call too). The rules across runs
(resume, where the weights come from, the device and dtype) are its plan, settled first: plan.py.
"""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

import checkpoint_format
import cli
import data
import ddp
import devices
import doors
import loss
import plan
import run_folder
from checkpoint import Checkpoint, Rng, Scaler, diverged, restore_training, save_checkpoint
from common import UserError, note
from data import BatchSampler, ValSplit, dataset_dir, open_split, open_val_split, sequential_batches
from devices import DeviceName, DtypeName
from loss import LossConfig, training_loss
from model import GPT, PresetName, adamw, optimizer_step
from run_folder import append_log

SAME, HERE = plan.SAME, plan.HERE  # a field's resume rule (plan.resumed_settings): the same experiment; this command's


@dataclass
class TrainConfig(plan.ModelSettings, LossConfig):
    """train.py's settings; the model's (ModelSettings) and the objective's (loss.LossConfig) are inherited. Each
    field declares its rule (doors.field_rules): its type, its "range" (flag, --config, a checkpoint's train_config),
    "resume" (what --resume does: plan.resumed_settings) and "help" (--help, docs/training.md's table)."""
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
        **HERE, "help": "the settings not given: a 30-step tiny run (plan.QUICK), seconds on a CPU"})
    seed: int = field(default=1337, metadata={  # numpy's generators take no negative seed
        "range": (0, 2**32 - 1), **SAME, "help": "the initial weights, the batches, sampled negatives"})
    # starting from another checkpoint's weights (finetune.py sets these)
    init_from: str = field(default="", metadata={
        **SAME, "help": "start from this checkpoint's weights, or hf:ORG/NAME / hf:FOLDER (hf.py); empty: fresh"})
    add_lm_head: bool = field(default=False, metadata={
        "help": "add an untied LM head initialised from the input embeddings"})
    freeze_body: bool = field(default=False, metadata={"help": "train only the LM head"})


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
        return loss.validation_sums(h, y, self.model.output_weight, self.settings(), self.contrastive_table(),
                                    y_bytes, special)

    def contrastive_table(self) -> torch.Tensor | None:
        return loss.contrastive_table(self.model, self.config.loss, encoder=self.mask is not None)

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
        if why := checkpoint_format.declared_tensors_problem(saved, mine, "its objective"):
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
    totals = torch.zeros(len(loss.VAL_SUMS), dtype=torch.float64, device=how.device)
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
            totals += torch.stack([sums[name] for name in loss.VAL_SUMS])
    objective.train(was_training)
    sums = dict(zip(loss.VAL_SUMS, ddp.all_reduce_sum(totals).tolist()))
    if sums["tokens"] == 0:
        raise UserError("validation scored no tokens: the split is shorter than one block; use a smaller --block_size")
    return loss.val_metrics(sums, objective.contrastive_table() is not None, split.byte_counts is not None)


# The run: everything the loop needs, built once; one step; logs; checkpoints

class Run:
    """One training run. Built (the start: data, weights, objective, optimizer, all restored on --resume),
    then driven by train(): validate, step, log_progress, save."""

    tracker = None  # while train() runs with --tensorboard or --wandb: tracking.Tracker, which Run.log feeds

    def __init__(self, settled: plan.Plan | TrainConfig, given: Iterable[str] | None = None):
        if not isinstance(settled, plan.Plan):  # built in code (a notebook, a test): its plan first
            settled = plan.settle(settled, cli.given_settings(settled, given))
        self.cfg = cfg = settled.cfg  # its dtype as it resolved on the device (plan.settled_dtype)
        self.device = ddp.init_distributed(settled.device)  # under torchrun, this rank's GPU
        self.dtype = getattr(torch, cfg.dtype)
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left
        data_dirs = [dataset_dir(name, cfg.data_root) for name in cfg.dataset.split(",")]  # prepared: train()
        first = common.through_door(doors.dataset, data_dirs[0])  # meta.json, and any tokenizer.json (checked)
        self.out_dir = Path(cfg.out_dir)
        model, self.state, start = plan.starting_point(settled, first.meta, self.device)
        resuming = settled.resuming
        self.resumed_step = start.state.step if resuming else None
        self.changed = list(settled.changed)  # in the first record after a resume
        self.run_id = start.run_id if resuming else run_folder.new_run_id()  # in its checkpoint and log records
        self.model = model = model.to(self.device)
        for name, p in model.named_parameters():
            p.requires_grad = not cfg.freeze_body or name.startswith("lm_head.")
        self.mask = None
        if cfg.objective == "mlm":
            from masking import Masking  # BERT masking of every batch, validation on fixed masks
            self.mask = Masking(first.meta, cfg.seed)
        self.objective = Objective(model, LossConfig.of(cfg), self.mask).to(self.device)
        self.scored_rows = scored_rows(cfg.batch_size, cfg.block_size, self.mask)
        self.objective.size_for(self.scored_rows)
        if start is not None:  # its learned pieces: exactly on --resume; those that fit from another run
            self.objective.load_own_state(start.objective, settled.source, exactly=resuming)
        self.optimizer = adamw(self.objective, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.eps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        if resuming:  # exactly: the optimizer, the fp16 loss scale, the random state
            restore_training(start, self.out_dir / "ckpt.safetensors", self.optimizer, self.scaler,
                             self.objective.named_parameters(), self.device)
        vocab = model.config.vocab_size
        if len(data_dirs) == 1:
            self.sampler = BatchSampler(open_split(data_dirs[0], "train", vocab), cfg.batch_size, cfg.block_size,
                                        cfg.seed, self.device)
        else:  # micro-batch i from a source drawn by (seed, i), p ~ tokens^mix_alpha
            from mixing import MixedSampler
            self.sampler = MixedSampler(data_dirs, cfg, cfg.block_size, vocab, self.device)
        self.val_splits = {d.name: open_val_split(d, vocab, bytes=not self.mask) for d in data_dirs}
        self.tokens_per_step = cfg.grad_accum * ddp.world_size() * cfg.batch_size * cfg.block_size
        self.saved_with = dict(  # what each checkpoint carries besides the weights and the counts
            data_meta=first.meta, mask_spec=self.mask.spec if self.mask else None, tokenizer_json=first.tokenizer_json,
            run_id=self.run_id, init=plan.lineage_init(cfg, model, start),
            mix=dict(zip(self.sampler.names, self.sampler.probabilities)) if len(data_dirs) > 1 else None)
        self.saved_step = None
        if cfg.compile:  # one graph for every objective: a graph break would be an error (tests/test_compile.py)
            self.objective.compile(fullgraph=True)
        self.wrapped = ddp.wrapped(self.objective)  # what runs each micro-batch: under torchrun, in DDP
        self.describe()

    def describe(self) -> None:
        cfg = self.cfg
        if cfg.num_negatives is not None and cfg.loss != "ce" and ddp.is_main_process():
            from negatives import warn_if_every_negative
            warn_if_every_negative(cfg.num_negatives, self.candidates())
        trainable = sum(p.numel() for group in self.optimizer.param_groups for p in group["params"])
        ranks = f" x {ddp.world_size()} ranks" if ddp.world_size() > 1 else ""
        note(f"model {cfg.preset}: {self.model.num_params(False) / 1e6:.2f}M parameters without embeddings, "
             f"{self.model.num_params() / 1e6:.2f}M with ({trainable / 1e6:.2f}M trainable) | loss {cfg.loss} | "
             f"{self.device.type}{ranks} {cfg.dtype} | {self.tokens_per_step:,} tokens/step")

    def log(self, record: dict) -> None:
        """The one writer of log.jsonl: every record carries the step, the tokens seen and the run's id."""
        if ddp.is_main_process():
            record = {"step": self.state.step, "tokens": self.state.tokens, **record, "run_id": self.run_id}
            if self.changed:
                record["changed"], self.changed = self.changed, []
            append_log(self.out_dir, record)
            if self.tracker:
                self.tracker.log(record)

    def tracked(self) -> contextlib.AbstractContextManager:
        """--tensorboard and --wandb (tracking.py): while the loop runs, every record self.log writes goes there too."""
        if not (self.cfg.tensorboard or self.cfg.wandb):
            return contextlib.nullcontext()
        from tracking import Tracker
        return Tracker(self)

    def validation_due(self) -> bool:
        """At every eval_interval-th step and the last, unless done: a run stopped at one owes it to --resume."""
        step = self.state.step
        at_point = step % self.cfg.eval_interval == 0 or step == self.cfg.max_iters
        return at_point and self.state.val_step != step

    def validate(self) -> None:
        """Validation metrics, printed and logged; a non-finite one stops the run before any save."""
        cfg = self.cfg
        how = Validation(batch_size=cfg.batch_size, block_size=cfg.block_size, device=self.device, dtype=self.dtype,
                         max_batches=cfg.eval_batches, compile=cfg.compile)
        try:  # the metrics' rule (loss.val_metrics): each finite, or None where it scored no rows
            per_source = {name: evaluate(self.objective, split, how) for name, split in self.val_splits.items()}
        except loss.NotFinite as e:
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
            group["lr"] = plan.lr_at(self.state.step, cfg)
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
                rng = negatives_rng.manual_seed(data.stream_seed(cfg.seed, index, data.NEGATIVES_STREAM))
                order = torch.randperm(y.numel() * ddp.world_size(), generator=rng).to(self.device)
            torch.manual_seed(data.stream_seed(cfg.seed, index, data.DROPOUT_STREAM))  # dropout masks too
            last = micro == cfg.grad_accum - 1  # DDP all-reduces the gradients once, after the last one
            with self.wrapped.no_sync() if ddp.world_size() > 1 and not last else contextlib.nullcontext():
                with devices.autocast_context(self.device, self.dtype):
                    micro_loss = self.wrapped(x, y, order) / cfg.grad_accum
                self.scaler.scale(micro_loss).backward()
            loss_sum += micro_loss.detach()
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
        columns = loss.scored_columns(cfg.loss, self.model.config.vocab_size, candidates, cfg.num_negatives)
        share = self.scored_rows / (cfg.batch_size * cfg.block_size)  # of the positions, those the loss scores
        per_token = self.model.flops_per_token(cfg.block_size, share * columns, body_backward=not cfg.freeze_body)
        return per_token * cfg.batch_size * cfg.block_size * ddp.world_size()

    def log_progress(self, loss_sum: torch.Tensor, stop: common.StopFlag, since: tuple[float, int]) -> bool:
        """One all-reduce (the mean loss over ranks, and whether any rank must stop), a progress line (tokens/s and
        MFU since `since`: a (time, step) pair) and a log record; returns whether to stop."""
        state = self.state
        totals = ddp.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(stop.requested), device=self.device)]))
        state.loss = totals[0].item() / ddp.world_size()
        if not math.isfinite(state.loss):
            raise diverged("loss", state.loss, state.step, self.out_dir / "ckpt.safetensors")
        lr = plan.lr_at(state.step - 1, self.cfg)
        tok_s = (state.step - since[1]) * self.tokens_per_step / max(time.time() - since[0], 1e-9)
        eta = int((self.cfg.max_iters - state.step) * self.tokens_per_step / tok_s)
        peak = devices.peak_flops(self.device)
        mfu = {"mfu": tok_s / ddp.world_size() * state.flops / state.tokens / peak} if peak else {}  # a share
        shown = f" | MFU {100 * mfu['mfu']:.1f}%" if peak else ""
        note(f"step {state.step}/{self.cfg.max_iters} | loss {state.loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
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
    """Run training as configured; returns a summary (first and last validation, tokens, FLOPs, and whether a
    signal stopped it: `interrupted`, its number in `signal`). `given`: the settings the user gave (cli.parse_given;
    None: those unlike their defaults), the others on --resume the run's own; `idle`: as plan.settle's. Its paths
    are declared, its plan settled and its out_dir claimed (its lock taken) before anything is written."""
    starts_from = None if run_folder.resumes(cfg.out_dir, cfg.resume) else cfg.init_from  # a resume reads its own
    declared = plan.declare_paths(cfg, "--init_from", starts_from)
    settled = plan.settle(cfg, cli.given_settings(cfg, given), idle)
    cfg = settled.cfg
    declared.also_reads("--dataset", [dataset_dir(name, cfg.data_root) for name in cfg.dataset.split(",")])
    out_dir = Path(cfg.out_dir)
    with run_folder.claim_out_dir(out_dir, cfg.resume, cfg.overwrite), run_folder.compiler_cache(out_dir):
        # The one write outside out_dir: the built-in corpus (shakespeare, shakespeare-bpeN) prepared on first use, a
        # folder a killed prepare.py left mid-swap put back; by rank 0, while the others wait (the group joined first)
        ddp.init_distributed(settled.device)
        from prepare import ensure_dataset  # the preparing room: only this step of a run enters it
        for name in cfg.dataset.split(","):
            ensure_dataset(name, cfg.data_root)
        return train_claimed(settled)


def train_claimed(settled: plan.Plan) -> dict[str, Any]:
    """train() in its claimed out_dir, its data prepared."""
    run = Run(settled)
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
    with common.StopFlag() as stop, run.tracked():
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


def main(argv: list[str]) -> None:
    cfg, given = cli.parse_given(TrainConfig, argv, plan.QUICK)
    summary = train(cfg, given, plan.idle_settings)
    if summary["signal"] is not None:  # a planned stop (--stop_at) exits 0
        raise common.Interrupted(summary["signal"])


if __name__ == "__main__":
    common.run_main(main)

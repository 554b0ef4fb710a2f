"""What a checkpoint holds, declared once: Checkpoint and its parts (State, the counts of the loop; Init, how the
lineage's first weights were drawn; MaskSpec, an encoder's masking; Scaler; Rng), each field with its type and,
where it has one, its range, as settings are declared. train.py's Run.save builds a Checkpoint and save_checkpoint
writes it; load_checkpoint lets one in through its door and every reader gets its attributes. The door derives its
checks from the declarations (doors.declared_problem: types, ranges, every float finite, nested tables), then checks
what the fields say together (weights against the model, ids against the vocabulary). A fork that keeps new run
state adds a field with a default to State: saved, checked and restored on --resume, with no other edit
(docs/hacking.md). Its format (safetensors, a CRC-32) and the door's checks across fields: checkpoint_format.py."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import checkpoint_format as fmt
import doors
from common import UserError, first_line, through_door
from model import GPT, GPTConfig, from_checkpoint
from safe_files import atomic_file

COUNT = doors.COUNT_RANGE
FLOPS = {"range": (0, 1e30)}  # a float count: past 2^62 within ~6B tokens of GPT-2 124M; beyond any run (~1e26)
Metrics = dict[str, float | None]  # validation metrics (loss.val_metrics): each finite, or None where no row scored


@dataclass
class State:
    """What the loop counts. It travels in the checkpoint, so a resumed run goes on exactly: a field added here, with
    a default, is saved, checked against its type and range, and restored on --resume (plan.starting_point)."""
    step: int = field(default=0, metadata=COUNT)
    micro_batches: int | None = field(default=0, metadata=COUNT)  # consumed by all ranks: the position in the data
    #   stream, whatever the split (None: written before runs counted it, so it cannot resume exactly)
    tokens: int = field(default=0, metadata=COUNT)  # tokens and FLOPs of this run, summed as they are spent
    flops: float = field(default=0.0, metadata=FLOPS)
    earlier_tokens: int = field(default=0, metadata=COUNT)  # ... and of the checkpoints it started from
    earlier_flops: float = field(default=0.0, metadata=FLOPS)
    loss: float | None = None
    first_val: Metrics | None = None
    val: Metrics | None = None
    val_step: int | None = field(default=None, metadata=COUNT)  # the step `val` was measured at: a run stopped
    #   before it is owed one


@dataclass
class Init:
    """What rebuilds the first weights of a run's lineage exactly (analyze.py's drift): a fresh model's seed and
    shape (plan.lineage_init)."""
    seed: int = field(metadata={"range": (0, 2**32 - 1)})
    model_config: GPTConfig


@dataclass(frozen=True)
class MaskSpec:
    """What masking needs to know of the tokenizer (masking.py); stored in MLM checkpoints as `mask_spec`."""
    mask_token: int = field(metadata=COUNT)  # GPT-2 has no [MASK]: the first unused id of the padded embedding
    vocab_size: int = field(metadata={"range": (1, doors.MAXIMA["vocab_size"])})  # the tokenizer's ids are below
    #   this; random replacements are drawn among them
    special_tokens: tuple[int, ...]  # never drawn as a replacement, chosen only to make up the count (end-of-text)


@dataclass
class Scaler:
    """torch.amp.GradScaler's state (fp16 runs)."""
    scale: float = field(metadata=COUNT)
    growth_factor: float = field(metadata=COUNT)
    backoff_factor: float = field(metadata=COUNT)
    growth_interval: int = field(metadata={"range": (1, doors.BIG)})
    _growth_tracker: int = field(metadata=COUNT)


GENERATOR_STATE = {"dtypes": ("a generator's state (uint8)", torch.uint8)}  # a field's tensors' dtypes, named


@dataclass
class Rng:
    """The random states a resumed run continues from."""
    torch: torch.Tensor = field(metadata=GENERATOR_STATE)
    cuda: torch.Tensor | None = field(default=None, metadata=GENERATOR_STATE)


@dataclass
class Checkpoint:
    """What train.py and finetune.py save (Run.save), and what an import (hf.py) is read as."""
    model: dict[str, torch.Tensor] = field(metadata={"dtypes": ("a floating-point tensor", *doors.WEIGHT_DTYPES)})
    model_config: GPTConfig
    train_config: dict[str, Any] = field(default_factory=dict)  # the run's settings: train.TrainConfig's fields,
    #   checked by the settings class a reader passes (a reader that has none: plain values)
    data_meta: dict[str, Any] = field(default_factory=dict)  # its dataset's meta.json (doors.DatasetMeta's fields)
    objective: dict[str, torch.Tensor] = field(default_factory=dict)  # the objective's own state (train.Objective)
    state: State | None = None  # None: an import
    optimizer: dict[str, Any] | None = None  # torch's state_dict of the optimizer (fmt.optimizer_problem checks it)
    scaler: Scaler | None = None
    rng: Rng | None = None
    mask_spec: MaskSpec | None = None  # an encoder's
    tokenizer_json: str | None = None  # its dataset's tokenizer.json, carried (None: tiktoken's)
    mix: dict[str, float] | None = field(default=None, metadata={"range": (0, 1)})  # a mix's sources' shares
    init: Init | None = None
    run_id: str | None = None  # in its checkpoint and log records (run_folder.new_run_id)

    def pretrain_tokens(self) -> int:
        """The tokens its lineage has read (0: unknown, an import)."""
        return self.state.earlier_tokens + self.state.tokens if self.state else 0

    def pretrain_flops(self) -> float:
        return self.state.earlier_flops + self.state.flops if self.state else 0.0


# ---------------------------------------------------------------------------------------------- the door


def read_checkpoint(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """A train.py or finetune.py checkpoint through its door: its bytes (checkpoint_format.checkpoint_file:
    safetensors, one open file, its checksum), today's layout, then every field against its declaration, then what
    they say together (fmt.checkpoint_problem). `train_class`: the settings class its train_config is checked by
    (train.TrainConfig), where the reader has it."""
    payload = fmt.checkpoint_file(path)
    if not isinstance(payload.get("model"), dict) or "model_config" not in payload:
        raise doors.Refused(f"{path} is not a headless-lm checkpoint (no model weights); {fmt.FIX}")
    fmt.refuse_earlier_layout(path, payload)
    optimizer = payload.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict):  # JSON's keys are text: ids again
        optimizer["state"] = {int(k) if k.isascii() and k.isdigit() else k: v for k, v in optimizer["state"].items()}
    if why := fmt.checkpoint_problem(payload, Checkpoint, train_class):
        raise doors.Refused(f"checkpoint {path}: {why}; {fmt.FIX}")
    return doors.declared(Checkpoint, payload)


PLANNED = ("model_config", "train_config", "state")  # what a plan reads of a checkpoint's document (plan.settle)


def read_document(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """A checkpoint's document alone (its safetensors metadata: the settings and counts; no tensor read, so no
    checksum pass): what a command settles its plan from (plan.settle) before it touches anything. The fields a
    plan reads are checked against their declarations and together (fmt.settings_problems); the rest are left empty
    here, and the whole file passes read_checkpoint's door when the run is built."""
    payload = fmt.checkpoint_file(path, whole=False)
    if "model_config" not in payload:
        raise doors.Refused(f"{path} is not a headless-lm checkpoint (no model_config); {fmt.FIX}")
    fmt.refuse_earlier_layout(path, payload)
    planned = {k: v for k, v in payload.items() if k in PLANNED}
    why = doors.declared_problem(planned, Checkpoint, partial=True)
    if why := why or next(filter(None, fmt.settings_problems(planned, Checkpoint, train_class)), None):
        raise doors.Refused(f"checkpoint {path}: {why}; {fmt.FIX}")
    return doors.declared(Checkpoint, {"model": {}, **planned})


# ---------------------------------------------------------------------------------------------- writing, reading


def save_checkpoint(path: str | Path, ckpt: Checkpoint | dict) -> None:
    """Write atomically as safetensors (checkpoint_format.encode_checkpoint); refused, the previous file untouched,
    when a weight or a metric is not finite. A dict: a payload as a file holds it (an older checkpoint: convert.py)."""
    payload = doors.plain(ckpt)
    state = payload.get("state") or {}
    values = {"the training loss": state.get("loss"), **(state.get("val") or {})}
    weights = (f"weight {k} is not finite" for k, t in payload["model"].items()
               if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    metrics = (f"{k} is {v}" for k, v in values.items() if v is not None and not math.isfinite(v))
    problem = next(weights, None) or next(metrics, None)
    if problem:
        raise UserError(f"not saving {path}: {problem} at step {state.get('step', '?')}; "
                        f"{last_good_checkpoint(path)}. Lower --lr or raise --warmup_iters")
    try:
        with atomic_file(path) as f:
            for piece in fmt.checkpoint_bytes(payload):
                f.write(piece)
    except UserError as e:  # no space left
        raise UserError(f"{e}; {last_good_checkpoint(path)}. Free some space, then continue with --resume"
                        ) from None


def diverged(what: str, value: float, step: int, ckpt: Path) -> UserError:
    """The error that stops a run whose loss or metric is no longer finite, before it saves anything."""
    return UserError(f"{what} became {value} at step {step}; stopped without saving ({last_good_checkpoint(ckpt)}): "
                     "lower --lr or raise --warmup_iters")


def last_good_checkpoint(path: str | Path) -> str:
    try:  # what a user can continue from after a refused or failed save: a checkpoint its doors accept whole
        ckpt = read_checkpoint(path)
        fmt.resumable(path, ckpt)
        return f"the last good checkpoint is {path} (step {ckpt.state.step})"
    except Exception:  # none yet, unreadable, or damaged
        return "there is no earlier checkpoint"


def restore_training(resumed: Checkpoint, path: Path, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     parameters: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """Continue exactly (train.Run on --resume): the optimizer, the fp16 loss scale, the random state (the weights
    are in), once they fit the parameters built, in optimizer order (checkpoint_format.resumable)."""
    through_door(fmt.resumable, path, resumed, optimizer.param_groups, parameters)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(resumed.optimizer)
    except (KeyError, ValueError):
        raise UserError(f"{path} holds the optimizer of other trainable parameters; resume with the interrupted "
                        "run's settings (--freeze_body, --loss)") from None
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)  # this run's betas, decay and eps (the saved run's unless a flag changed them)
    if scaler.is_enabled() and resumed.scaler:
        scaler.load_state_dict(dataclasses.asdict(resumed.scaler))
    torch.set_rng_state(resumed.rng.torch)
    if device.type == "cuda" and resumed.rng.cuda is not None:
        torch.cuda.set_rng_state(resumed.rng.cuda)


def load_checkpoint(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """A checkpoint through its door (read_checkpoint: safetensors and its checksum, then every field, before
    anything is built; tensors memory-mapped; its train_config by the rules of `train_class`' fields, where the
    reader has it: train.TrainConfig). An hf: source is a script's to accept: load.load_source."""
    return through_door(read_checkpoint, path, train_class)


def load_document(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """What a plan reads of a checkpoint (read_document, through its door: its settings and counts, no tensor)."""
    return through_door(read_document, path, train_class)


def model_of(ckpt: Checkpoint, **overrides: Any) -> GPT:
    """The one place every reader's model gets its weights (checkpoint_model, load_model): the checkpoint's, checked
    against its config first (model.from_checkpoint: a TypeError or ValueError names what does not fit)."""
    weights = ckpt.model  # a fork's other weights (a moving average it saves) are picked here
    return from_checkpoint(weights, dataclasses.replace(ckpt.model_config, **overrides))


def checkpoint_model(ckpt: Checkpoint, path: str | Path, **overrides: Any) -> GPT:
    """The model of a loaded checkpoint (model_of), a mismatch said in one line."""
    try:
        return model_of(ckpt, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"{path} does not match this model code: {first_line(e)}") from None


def load_model(path: str, device: str | torch.device = "cpu") -> GPT:
    """A train.py or finetune.py checkpoint's model, in eval mode: for notebooks and other programs. Read through
    the checkpoint's door (read_checkpoint): a bad file is a ValueError (doors.Refused) naming the problem."""
    ckpt = read_checkpoint(path)  # its train_config, which the model does not read, as plain values
    return model_of(ckpt).to(device).eval()

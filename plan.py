"""A run's plan: the rules of its settings across runs (resume, the model, the schedule, the device and dtype, the
data, where the weights come from), settled in one step (settle) before the run touches anything. Each setting's own
rule is declared on its field (train.TrainConfig); a fork opens this file only to change a rule across them. It is
generic over the settings class it settles (type(cfg)): one plan serves train.py and finetune.py, and it imports
nothing above it."""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cli
import common
import ddp
import devices
import doors
import io_checks
import run_folder
from checkpoint import Checkpoint, Init, State, checkpoint_model
from common import UserError, note
from data import check_same_data, dataset_dir, recorded_dataset, same_tokenizer
from load import load_source, source_document
from loss import LossConfig
from model import GPT, PRESETS, GPTConfig, padded_vocab_size

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

# The paper's schedule for the Pythia shapes: cosine to 0 after a 1% warmup (1430 of 143,000 steps); lr,
# betas, decay and clip are TrainConfig's defaults. Short CPU runs warm up over 10% and end at lr / 10.
RECIPES = {"pythia-70m": dict(warmup=0.01, final_lr=0.0), "pythia-160m": dict(warmup=0.01, final_lr=0.0)}
DEFAULT_RECIPE = dict(warmup=0.1, final_lr=0.1)
# --quick: a run of seconds on a CPU (30 steps of the tiny preset on short sequences), the tests' tiny_config too
QUICK = dict(preset="tiny", block_size=32, batch_size=8, max_iters=30, warmup_iters=5, eval_interval=10,
             eval_batches=2, log_interval=1)


def lr_at(step: int, cfg: Any) -> float:
    """Linear warmup, then cosine decay to min_lr (or constant, as the paper's text has the fine-tune)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def same_settings(cls: type) -> tuple[str, ...]:
    """What makes a resumed run the same experiment: the fields whose rule is "resume": "same" (the data, the batch,
    the model, every setting of the objective that changes its loss). Any other given may change (--max_iters)."""
    return tuple(f.name for f in dataclasses.fields(cls) if doors.field_meta(cls, f.name).get("resume") == "same")


@dataclass(frozen=True)
class Plan:
    """A run's whole plan, settled (settle) before it touches anything: its effective settings (the dtype as it
    resolved on the device), the checkpoint its weights come from (its own on --resume, --init_from's, or none: ""),
    what a resume changes, and the device (pick_device's; under torchrun each rank's GPU is ddp's)."""
    cfg: Any
    source: str = ""
    resuming: bool = False
    changed: list[str] = field(default_factory=list)  # settings given on --resume unlike the run's, as said and logged
    device: torch.device = torch.device("cpu")


def declare_paths(cfg: Any, flag: str, starts_from: str | None) -> io_checks.Declared:
    """The paths a run names (`flag`: the checkpoint it starts from, never one still training; its out_dir), declared
    before a byte of them is read (io_checks.declare_io); a live run's folder is named at once."""
    declared = io_checks.declare_io(reads={flag: starts_from}, writes={"--out_dir": run_folder.run_files(cfg.out_dir)},
                                    kinds={flag: "start"})
    if ddp.launched_as_rank_0():
        run_folder.check_out_dir(Path(cfg.out_dir))
    return declared


def settle(cfg: Any, given: frozenset[str], idle: Callable[[Any], dict] | None = None) -> Plan:
    """The effective settings, in one step with no side effect: the flags and --config (`given`: the names given),
    the checkpoint's document (the run's own on --resume, else --init_from's: its settings and counts, no tensor
    read: load.source_document), the preset, the device and dtype; then every check on them, once (ranges, rules
    between settings, `idle`: the script's idle_settings among those given, what a resume must keep). Nothing is
    prepared or written."""
    if cfg.resume and cfg.overwrite:  # the command's own flags, before what they name is read
        raise UserError("--resume continues the run in --out_dir and --overwrite starts it over; pass one of them")
    cfg, own = resumed(cfg, given)
    resuming = own is not None
    source = str(run_folder.run_files(cfg.out_dir)[0]) if resuming else cfg.init_from
    start = own if resuming or not source else source_document(source, type(cfg))
    before = start.train_config if start else {}
    device = devices.pick_device(cfg.device)
    cfg = dataclasses.replace(cfg, dtype=settled_dtype(cfg, device, given, source if resuming else ""))
    changed = [f"--{k}={cli.brief_value(getattr(cfg, k))} (the run had {cli.brief_value(before[k])})"
               for k in sorted(given & set(before)) if resuming and getattr(cfg, k) != before[k]
               and doors.field_meta(type(cfg), k).get("resume") != "here"]
    check_config(cfg)
    if idle:
        cli.refuse_idle(cfg, {k: why for k, why in idle(cfg).items() if k in given})
    cfg = with_schedule(cfg, before, start.state.step if resuming else None, given)
    cfg = with_model(cfg, dataclasses.asdict(start.model_config) if start else None, source)
    if start:
        check_continuation(cfg, start, source, resuming)
    common.through_door(doors.check_step, cfg.batch_size, cfg.grad_accum, cfg.block_size)
    return Plan(cfg, source, resuming, changed, device)


def resumed(cfg: Any, given: frozenset[str]) -> tuple[Any, Checkpoint | None]:
    """On --resume, the run's own settings where not given (resumed_settings) and its checkpoint's document (its
    settings and counts); a new run's settings as they are, and None. train.py's and finetune.py's plans alike."""
    ckpt = run_folder.run_files(cfg.out_dir)[0]
    if not run_folder.resumes(cfg.out_dir, cfg.resume):
        if cfg.resume is True:
            raise UserError(f"--resume: {ckpt} not found; pass the run's --out_dir, or start without --resume")
        return cfg, None
    own = source_document(ckpt, type(cfg))
    if own.state is None or own.state.micro_batches is None:
        raise UserError(f"{ckpt} was written before runs counted their data position, so it cannot resume "
                        f"exactly; start a new run from its weights with --init_from={ckpt}")
    cfg = resumed_settings(cfg, given, own.train_config, ckpt)
    if "dataset" not in given:  # the run's own, looked for under this command's --data_root (a "here" setting)
        for name in cfg.dataset.split(","):
            if not (dataset_dir(name, cfg.data_root) / "meta.json").exists():
                recorded_dataset(name, cfg.data_root, ckpt)  # refused naming --data_root; a built-in one is prepared
    return cfg, own


def command_of(settings: Iterable[str]) -> str:
    """The command whose runs hold these settings (a checkpoint's train_config, or a settings class's fields): a
    fine-tune's hold finetune.py's own --ckpt; train.py's do not."""
    return "finetune.py" if "ckpt" in settings else "train.py"


def resumed_settings(cfg: Any, given: frozenset[str], before: dict, source: str | Path) -> Any:
    """The one rule of --resume, by each field's "resume" (doors.field_meta): a setting not given is the run's own
    (`before`: its saved train_config); a given one applies from here on ("kept"), or must be the run's own
    ("same": another value is another experiment); "here" ones are this command's. The run is continued by the
    command that made it (command_of): the other would drop or misread its settings."""
    ours, theirs = command_of(f.name for f in dataclasses.fields(cfg)), command_of(before)
    if ours != theirs:
        raise UserError(f"{cfg.out_dir} holds a {theirs} run; continue it with "
                        f"{shlex.join(['python', theirs, '--resume', f'--out_dir={cfg.out_dir}'])}")
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


def settled_dtype(cfg: Any, device: torch.device, given: frozenset[str], resumed_from: str = "") -> str:
    """What the run computes in, resolved on this device (auto: devices.pick_dtype) and recorded so: a resume
    continues in it, and a change is a change of value. A dtype given that the device lacks is refused (pick_dtype),
    and a resumed run's own that it lacks (it would not be the same run)."""
    name = cfg.dtype
    lacks = (name == "float16" and device.type != "cuda"
             or name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported())
    if resumed_from and lacks and "dtype" not in given:
        raise UserError(f"{resumed_from} computes in {name}, which this {device.type} device lacks; resume it where "
                        "it has it, or pass --dtype=float32 to go on in another precision (no longer exact)")
    return str(devices.pick_dtype(name, device)).removeprefix("torch.")


def with_schedule(cfg: Any, before: dict, resumed_step: int | None = None, given: frozenset[str] = frozenset()) -> Any:
    """The preset (the checkpoint's, else tiny) and the schedule: the warmup and final lr not set take the preset's
    recipe (a resumed run has its own: resumed_settings); a longer --max_iters that stretches a resumed cosine
    says so."""
    preset = cfg.preset or before.get("preset") or "tiny"
    recipe = RECIPES.get(preset, DEFAULT_RECIPE)
    warmup = max(1, round(recipe["warmup"] * cfg.max_iters)) if cfg.warmup_iters is None else cfg.warmup_iters
    min_lr = recipe["final_lr"] * cfg.lr if cfg.min_lr is None else cfg.min_lr
    new = dataclasses.replace(cfg, preset=preset, warmup_iters=warmup, min_lr=min_lr)
    check_stop_at(new, resumed_step)
    if new.min_lr > new.lr:  # the fix names what was given; nothing given: the run's own settings disagree
        whose = "given" if "lr" in given or resumed_step is None else "this run resumes with"
        fix = f"lower --min_lr (at most {new.lr:g}), or raise --lr"
        if "min_lr" in given or resumed_step is None:
            raise UserError(f"--min_lr={new.min_lr:g} is above the lr {new.lr:g} {whose}; {fix}")
        if "lr" in given:
            raise UserError(f"--lr={new.lr:g} is below the min_lr {new.min_lr:g} this run resumes with; pass "
                            "--min_lr too (at most --lr)")
        raise UserError(f"this run resumes with min_lr {new.min_lr:g}, above its lr {new.lr:g}; resume with --min_lr "
                        f"at most {new.lr:g}, or with --lr at least {new.min_lr:g}")
    old = dataclasses.replace(new, max_iters=before.get("max_iters", new.max_iters))
    if resumed_step is not None and old.max_iters != new.max_iters and new.lr_schedule == "cosine":
        note(f"note: --max_iters changed from {old.max_iters} to {new.max_iters} on resume: the cosine schedule now "
             f"decays over {new.max_iters} steps (lr at step {resumed_step}: {lr_at(resumed_step, new):.2e}, was "
             f"{lr_at(resumed_step, old):.2e})")
    return new


def check_stop_at(cfg: Any, resumed_step: int | None) -> None:
    """--stop_at ends this command early on the schedule of --max_iters: a step still ahead, before the end."""
    if cfg.stop_at is not None and cfg.stop_at >= cfg.max_iters:
        raise UserError(f"--stop_at={cfg.stop_at} changes nothing: the run ends at --max_iters={cfg.max_iters}; "
                        f"drop it, or stop earlier (below {cfg.max_iters})")
    if cfg.stop_at is not None and resumed_step is not None and cfg.stop_at <= resumed_step:
        raise UserError(f"--stop_at={cfg.stop_at} but the run is at step {resumed_step} already; pass a later step "
                        f"(below --max_iters={cfg.max_iters}), or drop it to go on to the end")


def with_model(cfg: Any, before: dict | None = None, source: str | Path = "") -> Any:
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


def derived_fields(cfg: Any, meta: dict) -> dict[str, Any]:
    """The model fields that other settings decide, for a fresh model: an encoder gets room for the [MASK] id past
    the tokenizer's ids; a separate output matrix for nce and --untied_head."""
    mlm = cfg.objective == "mlm"
    return {"vocab_size": padded_vocab_size(meta["vocab_size"] + mlm), "causal": not mlm,
            "lm_head": cfg.loss == "nce" or cfg.untied_head}


def check_config(cfg: Any) -> None:
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


def check_objective(cfg: Any) -> None:
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


def check_continuation(cfg: Any, start: Checkpoint, source: str | Path, resuming: bool) -> None:
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


def idle_settings(cfg: Any) -> dict[str, str]:
    """train.py's settings that a command line gives and that would change nothing (refused: cli.refuse_idle)."""
    idle = {}
    resuming = run_folder.resumes(cfg.out_dir, cfg.resume)
    if "," not in cfg.dataset:
        idle["mix_alpha"] = "without a mix (--dataset=A,B,...)"
    if cfg.lr_schedule == "constant":
        idle["min_lr"] = "with --lr_schedule=constant (the lr stays at --lr after the warmup)"
    if not cfg.init_from or resuming:
        idle["add_lm_head"] = "without --init_from (a new model has the head its --loss needs; a resumed run its own)"
    if resuming:
        idle["quick"] = "with --resume (a resumed run keeps its own settings)"
    return {**idle, **idle_anywhere(cfg)}


def idle_anywhere(cfg: Any) -> dict[str, str]:
    """The settings that change nothing in a train.py or finetune.py run alike."""
    idle = {}
    if not cfg.wandb:
        idle.update(dict.fromkeys(("wandb_project", "wandb_run_name"), "without --wandb"))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # torchrun sets it: the ranks the process group will have
        idle["negatives_scope"] = ("on one process (global scores against every rank's micro-batch: it is the local "
                                   "one here); run under torchrun")
    return idle


# Where the weights come from: a fresh model, the run's own checkpoint (--resume), or another run's (--init_from,
# which is what a fine-tune is), read whole once the run's data is open


def starting_point(plan: Plan, meta: dict, device: torch.device) -> tuple[GPT, State, Checkpoint | None]:
    """A fresh model, else the checkpoint the plan resumes or starts from, through its whole door now (its
    checksum, every tensor): the model, the counts, and the checkpoint started from (if any)."""
    cfg = plan.cfg
    if devices.ranks_agree(cfg, device, plan.resuming) not in (0, ddp.world_size()):  # same settings everywhere
        raise UserError(f"{plan.source} is seen by some ranks and not others: --out_dir must be on a filesystem "
                        "every node shares")
    if not plan.source:
        model = GPT(GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS}, **derived_fields(cfg, meta)))
        return model, State(), None
    source = plan.source
    start = load_source(source, type(cfg))
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


def lineage_init(cfg: Any, model: GPT, start: Checkpoint | None) -> Init | None:
    """What rebuilds the initial weights of this run's lineage exactly (analyze.py's drift): a fresh model's seed
    and shape (torch is seeded at the start of Run, and nothing draws before the model is built), else what the
    checkpoint it resumes or starts from carries (None for hf: imports and older checkpoints)."""
    if start is not None:
        return start.init
    return Init(seed=cfg.seed, model_config=dataclasses.replace(model.config))


def fit_output_layer(model: GPT, cfg: Any, source: str | Path) -> None:
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


def check_data(meta: dict, start: Checkpoint, source: str | Path, dataset: str) -> None:
    """A checkpoint continues on data of its own tokenizer, and on its own dataset only as it was (check_same_data):
    checked once the data is opened."""
    theirs = start.data_meta
    check_same_data(meta, start, source, dataset)
    if theirs.get("tokenizer") and not same_tokenizer(theirs, meta):
        raise UserError(f"{source} was trained with tokenizer {theirs['tokenizer']!r} but the dataset uses "
                        f"{meta['tokenizer']!r} (another vocabulary); prepare the data with the same --tokenizer")

"""CE vs CWT at equal training compute: the paper's headline experiment, small enough for a CPU.

    python compare.py                   # tiny preset on Shakespeare: CE, then CWT + its LM-head fine-tune
    python compare.py --json=results/compare.json --plot=results/compare.png
    python compare.py --preset=pythia-70m --dataset=roneneldan/TinyStories --lambada=lambada.jsonl
    python compare.py --vocab_sizes=1024,4096,16384 --json=results/vocab.json --plot=results/vocab.png
    python compare.py --negatives_sweep=16,64,256,unique,all --negatives_batch_sizes=4,8,16 --seeds=1337,1338

CE trains for --ce_iters steps; that sets the FLOP budget (GPT.flops_per_token). CWT then trains for as
many steps as fit in the same budget once its LM-head fine-tune (2% of its tokens, at CE's cost per token)
is paid for. All three models are scored on validation CE and, with --lambada, on LAMBADA, in this process
with train.py's, finetune.py's and eval.py's own functions.

The runs live in out_dir/ce, out_dir/cwt and out_dir/cwt-ft. A second compare.py into an out_dir that holds
them is refused: --resume skips the runs that finished and continues an interrupted one (Ctrl-C stops
compare.py, with the run's checkpoint saved), --overwrite starts every run over. --tensorboard and --wandb log each
run's records (tracking.py; `tensorboard --logdir=out-compare` shows them side by side).

--vocab_sizes=N1,N2,...: the same experiment once per vocabulary size, each with a byte-level BPE of N tokens
learned from the source's training split (the dataset prepared once, as prepare.py --tokenizer=bpe:N does it), in
out_dir/bpeN/. Every model is then scored in bits per byte on the whole validation split, which holds out the
same documents (chosen by a hash of their text) whatever the tokenizer: every size is scored on the same text.
Budgets are equal within a size, not across sizes (CE's cost grows with V). A size whose out_dir/bpeN/result.json
exists is skipped, so an interrupted sweep continues where it stopped. The paper compared vocabulary sizes on
GLUE with encoders (glue.py on encoders trained per size is its version); this decoder sweep is our extension.

--negatives_sweep=K1,...,unique,all: how many negatives CWT needs (docs/negatives.md). Series k: at --batch_size,
CWT with k sampled negatives, unique targets or all of the micro-batch; series batch (--negatives_batch_sizes):
CWT (all) as the batch grows, the paper's reading. Every point pre-trains --ce_iters steps, CWT then gets its
head fine-tune, CE runs at the same batch on the same tokens; each is scored on the whole validation split, once
per seed of --seeds (mean and spread), with its tokens, FLOPs and the cost of a step (bench.py). A point lives in
out_dir/b{batch}-{variant}-s{seed}; one whose result.json exists is skipped."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import doors
from checkpoint import Checkpoint, State, checkpoint_model, load_checkpoint
from cli import config_path, parse_flags, refuse_idle, within_ranges
from common import Interrupted, UserError, format_metric, need_extra, note, run_main, through_door
from data import BatchSampler, ValSplit, dataset_dir, load_meta, open_split, open_val_split, special_ids
from ddp import barrier, init_distributed, is_main_process
from devices import DeviceName, DtypeName, pick_device, pick_dtype
from doors import MAXIMA
from eval import load_lambada, score_lambada
from finetune import FinetuneConfig, finetune
from io_checks import declare_io, local_source
from loss import scored_columns
from model import PresetName, build_model, padded_vocab_size
from plan import MODEL_FIELDS, ModelSettings, check_config as check_train_config
from prepare import PrepareConfig, ensure_dataset, prepare
from results import import_pyplot, log_curves, plot_curves, save_figure, save_results, write_json
from tokenizer import dataset_tokenizer
from train import TrainConfig, Validation, evaluate, objective_of, train


@dataclass
class CompareConfig(ModelSettings):
    """compare.py's settings; the model's (plan.ModelSettings) are inherited, and given to every run."""
    preset: PresetName = field(default="tiny", metadata={"help": "the model's shape (model.py), for every run"})
    dataset: str = field(default="shakespeare", metadata={
        "help": "a prepared dataset under --data_root, or its folder; with --vocab_sizes: a source (prepare.py)"})
    data_root: str = field(default="data", metadata={"help": "where prepare.py put the datasets"})
    block_size: int = 128
    batch_size: int = field(default=8, metadata={"range": (1, 1 << 20), "help": "sequences per micro-batch"})
    ce_iters: int = field(default=240, metadata={
        "range": (1, 10**9), "help": "steps of the CE run: they set the FLOP budget both models get"})
    finetune_fraction: float = field(default=0.02, metadata={
        "range": (0, 1, "(]"), "help": "CWT's LM-head fine-tune, a share of its pre-training tokens (paper: 2%)"})
    lr: float = field(default=1e-3, metadata={"range": (0, 10, "(]"), "help": "peak learning rate (AdamW)"})
    warmup_fraction: float = field(default=0.1, metadata={"range": (0, 1),
                                                          "help": "warmup, a share of each pre-training run's steps"})
    evals: int = field(default=6, metadata={"range": (1, 10**6), "help": "validation points per pre-training run"})
    eval_batches: int = field(default=4, metadata={"range": (1, 10**9), "help": "micro-batches of a validation"})
    lambada: str = field(default="", metadata={"help": "a LAMBADA .jsonl to score every model on; empty: skipped"})
    out_dir: str = field(default="out-compare", metadata={"help": "the runs' folder: one folder per run"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "auto: bfloat16 on CUDA (float16 without it), float32 on the CPU"})
    seed: int = field(default=1337, metadata={"range": (0, 2**32 - 1),  # numpy's generators take no negative seed
                                              "help": "every run's seed: initial weights, batches"})
    json: str = field(default="", metadata={"help": "also write the results to this file"})
    plot: str = field(default="", metadata={"help": "an image of the curves (matplotlib)"})
    quick: bool = field(default=False, metadata={"help": "a few steps, for tests"})
    resume: bool = field(default=False, metadata={
        "help": "skip the runs in out_dir that finished; continue an interrupted one"})
    overwrite: bool = field(default=False, metadata={"help": "start every run in out_dir over"})
    vocab_sizes: list[int] = field(default_factory=list, metadata={  # each at least bpe.MIN_VOCAB: run_vocab_sweep
        "range": (1, MAXIMA["vocab_size"]), "help": "BPE sizes: the experiment once per vocabulary size"})
    negatives_sweep: list[str] = field(default_factory=list, metadata={
        "help": "CWT's negatives: k values, unique, all, each at --batch_size (docs/negatives.md)"})
    negatives_batch_sizes: list[int] = field(default_factory=list, metadata={
        "range": (1, 1 << 20), "help": "CE and CWT (all negatives) at each of these batch sizes"})
    seeds: list[int] = field(default_factory=list, metadata={
        "range": (0, 2**32 - 1), "help": "each point of a negatives sweep once per seed"})
    tensorboard: bool = field(default=False, metadata={"help": "each run's records to its out_dir/tb (tracking.py)"})
    wandb: bool = field(default=False, metadata={"help": "each run's records to Weights & Biases, a W&B run each"})
    wandb_project: str = field(default="headless-lm", metadata={"help": "the W&B project"})
    wandb_run_name: str = field(default="", metadata={
        "help": "NAME: the W&B runs are NAME/ce, NAME/cwt, ...; empty: their folders"})


RUNS = ("ce", "cwt", "cwt-ft")  # out_dir's folders, in the order they run
QUICK = dict(block_size=32, batch_size=2, ce_iters=2, evals=1, eval_batches=1, finetune_fraction=0.1)
# What makes a run in out_dir the one this compare.py plans (data_root, device and dtype may change).
SAME_RUN = ("dataset", "preset", "batch_size", "loss", "lr", "min_lr", "warmup_iters", "seed", "max_iters",
            *MODEL_FIELDS)


def check_config(cfg: CompareConfig) -> None:
    """Every setting within bounds, and every run's settings as train.py checks them, before any work: a bad
    seed of a sweep is refused before the first point trains."""
    within_ranges(cfg)
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume continues the runs in --out_dir and --overwrite starts them over: pass one")
    negatives = bool(cfg.negatives_sweep or cfg.negatives_batch_sizes)
    if negatives and cfg.vocab_sizes:
        raise UserError("--vocab_sizes and --negatives_sweep are two sweeps: pass one")
    if cfg.seeds and not negatives:
        raise UserError("--seeds runs each point of --negatives_sweep or --negatives_batch_sizes once per seed; "
                        "without a sweep pass --seed")
    if cfg.tensorboard or cfg.wandb:  # before any work, as train.py's check would be only at the first run
        need_extra("tracking", "--tensorboard and --wandb")
        from tracking import check_tracking
        check_tracking(cfg)
    for name in ("negatives_batch_sizes", "seeds"):
        values = getattr(cfg, name)
        if repeated := sorted({v for v in values if values.count(v) > 1}):
            raise UserError(f"--{name} lists {', '.join(map(str, repeated))} more than once; pass each value once")
    refuse_idle(cfg, {"seed": "with --seeds (each point runs once per seed of --seeds)"} if cfg.seeds else {})
    quick = with_quick(cfg)
    for seed in cfg.seeds or [cfg.seed]:  # each run as train.py will check it
        for batch in cfg.negatives_batch_sizes or [quick.batch_size]:
            check_train_config(pretrain_config(dataclasses.replace(quick, seed=seed, batch_size=batch), "cwt",
                                               quick.ce_iters, Path(cfg.out_dir)))


def with_quick(cfg: CompareConfig) -> CompareConfig:
    """--quick's small settings (QUICK) for those not given: a flag given keeps its value."""
    if not cfg.quick:
        return cfg
    defaults = CompareConfig()
    return dataclasses.replace(cfg, **{k: v for k, v in QUICK.items() if getattr(cfg, k) == getattr(defaults, k)})


def planned_folders(cfg: CompareConfig) -> list[Path]:
    """The run (or point, or size) folders this compare.py writes in out_dir."""
    root = Path(cfg.out_dir)
    if cfg.negatives_sweep or cfg.negatives_batch_sizes:
        need_extra("bench", "--negatives_sweep")
        series = negatives_series(with_quick(cfg))
        return [point_dir(root, b, v, s) for b, v in dict.fromkeys(p for pts in series.values() for p in pts)
                for s in cfg.seeds or [cfg.seed]]
    if cfg.vocab_sizes:
        return [root / f"bpe{n}" for n in sorted(set(cfg.vocab_sizes))]
    return [root / name for name in RUNS]


def declared_io(cfg: CompareConfig, argv: list[str]) -> None:
    """What compare.py reads and writes, declared before any work (io_checks.declare_io)."""
    if cfg.vocab_sizes:  # a source, and the datasets of each size prepared from it
        dataset = local_source(cfg.dataset)
        prepared = [dataset_dir(f"shakespeare-bpe{n}" if cfg.dataset == "shakespeare" else cfg.dataset, cfg.data_root,
                                tokenizer="gpt2" if cfg.dataset == "shakespeare" else f"bpe:{n}")
                    for n in sorted(set(cfg.vocab_sizes))]
    else:
        dataset, prepared = dataset_dir(cfg.dataset, cfg.data_root), []
    declare_io(reads={"--lambada": cfg.lambada, "--config": config_path(argv), "--dataset": dataset},
               writes={"--json": cfg.json, "--plot": cfg.plot, "--out_dir": planned_folders(cfg),
                       "the datasets it prepares": prepared})


def check_out_dir(cfg: CompareConfig) -> None:
    """Before any work: an out_dir holding an earlier compare.py's runs is continued or started over only when asked."""
    root = Path(cfg.out_dir)
    if any(p.exists() and not p.is_dir() for p in (root, *root.parents)):
        raise UserError(f"--out_dir={root}: it, or a folder above it, is a file; pass a folder")
    held = [name for name in RUNS if any((root / name / f).exists() for f in ("ckpt.safetensors", "log.jsonl"))]
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{root} holds the runs of an earlier compare.py ({', '.join(held)}); continue them with "
                        "--resume (same settings), start every run over with --overwrite, or pick another --out_dir")


def run_state(folder: Path) -> tuple[Checkpoint | None, list[dict] | None]:
    """A run folder's checkpoint and log, each through its door (None where there is none): damage is one line
    before any run of this compare.py starts (a line a crash cut short is allowed: a resumed run drops it)."""
    log, ckpt = folder / "log.jsonl", folder / "ckpt.safetensors"
    records = through_door(doors.run_log, log, True) if os.path.lexists(log) else None
    return (load_checkpoint(ckpt, TrainConfig) if os.path.lexists(ckpt) else None), records


def finished_run(run_cfg: TrainConfig) -> dict | None:
    """With --resume: the summary of a run in its folder that reached its planned steps (from its checkpoint: it is
    skipped), else None (train.py's --resume continues it, or it starts). A run of other settings is refused, as is a
    finished run whose log does not end with its last validation: its curve would be wrong."""
    path = Path(run_cfg.out_dir) / "ckpt.safetensors"
    ckpt, records = run_state(path.parent)
    if ckpt is None:
        return None
    before = ckpt.train_config
    for key in SAME_RUN:
        planned = getattr(run_cfg, key)
        if planned is not None and key in before and before[key] != planned:
            raise UserError(f"{path.parent} holds a run with {key}={before[key]!r} but this compare.py plans "
                            f"{key}={planned!r}; resume with that run's settings, start over with --overwrite, or "
                            "pick another --out_dir")
    state = ckpt.state or State()
    if state.step != run_cfg.max_iters or state.val_step not in (None, state.step):
        return None  # not there yet, or stopped before its last validation
    validated = [r["step"] for r in records or [] if "val_ce" in r]
    if (state.val or {}).get("val_ce") is None or validated[-1:] != [state.step]:
        raise UserError(f"{path.parent} holds a finished run whose validation at step {state.step} is missing from "
                        f"its checkpoint or its log.jsonl (deleted, cut short, damaged?); delete {path.parent} to run "
                        "it again with --resume")
    note(f"{path.parent}: finished earlier ({state.step} steps); skipped")
    return {"step": state.step, "val": state.val, "first_val": state.first_val, "loss": state.loss, "ckpt": str(path),
            "interrupted": False, "seconds": None, "tokens": ckpt.pretrain_tokens(), "flops": ckpt.pretrain_flops()}


def solve_cwt_iters(ce_iters: int, ce_flops_per_token: float, cwt_flops_per_token: float,
                    fraction: float) -> tuple[int, int]:
    """CWT pre-training steps n and fine-tune steps ceil(fraction * n) (same tokens per step) such that
    n * cwt + ft * ce <= ce_iters * ce FLOPs per token, with n as large as possible."""
    budget = ce_iters * ce_flops_per_token
    cost = lambda n: (n * cwt_flops_per_token  # noqa: E731
                      + max(1, math.ceil(fraction * n)) * ce_flops_per_token)
    n = max(1, int(budget / (cwt_flops_per_token + fraction * ce_flops_per_token)) + 1)
    while n > 1 and cost(n) > budget:
        n -= 1
    return n, max(1, math.ceil(fraction * n))


def run_once(name: str, run_cfg: TrainConfig, cfg: CompareConfig, start_over: bool = False) -> dict:
    """One run in its folder: continued with --resume (--resume=auto), started over with --overwrite or `start_over`."""
    resume = "auto" if cfg.resume and not start_over else False
    run_cfg = dataclasses.replace(run_cfg, resume=resume, overwrite=cfg.overwrite or start_over)
    summary = finetune(run_cfg) if isinstance(run_cfg, FinetuneConfig) else train(run_cfg)
    if summary["interrupted"]:  # Ctrl-C or SIGTERM: the run saved its checkpoint; the next ones wait
        note(f"compare.py stopped during {name}; continue it with the same settings and --resume")
        raise Interrupted(summary["signal"])
    return summary


def pretrain_config(cfg: CompareConfig, loss: str, iters: int, out_dir: Path, **negatives) -> TrainConfig:
    """A pre-training run of compare.py: cosine from cfg.lr to lr / 10 after a warmup of warmup_fraction."""
    return TrainConfig(loss=loss, max_iters=iters, lr=cfg.lr, min_lr=cfg.lr / 10,
                       warmup_iters=max(1, round(cfg.warmup_fraction * iters)),
                       eval_interval=max(1, iters // cfg.evals), out_dir=str(out_dir),
                       **shared_settings(cfg, out_dir), **negatives)


def finetune_config(cfg: CompareConfig, ckpt: Path, iters: int, out_dir: Path) -> FinetuneConfig:
    """The LM-head fine-tune of the checkpoint `ckpt` (finetune.py's recipe for the rest)."""
    return FinetuneConfig(ckpt=str(ckpt), max_iters=iters, warmup_iters=max(1, min(10, iters // 5)),
                          eval_interval=max(1, iters // 2), out_dir=str(out_dir), **shared_settings(cfg, out_dir))


def shared_settings(cfg: CompareConfig, out_dir: Path) -> dict:
    name = f"{cfg.wandb_run_name}/{out_dir.relative_to(cfg.out_dir)}" if cfg.wandb_run_name else ""
    return dict(model_settings(cfg), dataset=cfg.dataset, data_root=cfg.data_root, preset=cfg.preset,
                batch_size=cfg.batch_size, eval_batches=cfg.eval_batches, device=cfg.device, dtype=cfg.dtype,
                seed=cfg.seed, log_interval=max(1, cfg.ce_iters // 10), tensorboard=cfg.tensorboard,
                wandb=cfg.wandb, wandb_project=cfg.wandb_project, wandb_run_name=name)


def model_settings(cfg: CompareConfig) -> dict:
    """The model flags given to compare.py (block_size always), for each run's TrainConfig."""
    return {name: getattr(cfg, name) for name in MODEL_FIELDS}


def run_plan(plan: dict, cfg: CompareConfig) -> dict:
    """The runs of `plan` (name: its config) in order, each with run_once. With --resume, a finished run is
    skipped, and a fine-tune held in its folder starts over when the run it fine-tunes was trained further."""
    done = {name: finished_run(run_cfg) for name, run_cfg in plan.items()} if cfg.resume else {}
    runs = {}
    for name, run_cfg in plan.items():
        folder = Path(run_cfg.out_dir)
        held = any((folder / f).exists() for f in ("ckpt.safetensors", "log.jsonl"))
        base = next((b for b, c in plan.items() if isinstance(run_cfg, FinetuneConfig)
                     and run_cfg.ckpt == str(Path(c.out_dir) / "ckpt.safetensors")), None)
        stale = base is not None and cfg.resume and not done[base] and held
        if stale:  # it fine-tuned an earlier state of its base, trained further just now
            note(f"{folder}: it fine-tuned an earlier state of {Path(plan[base].out_dir)}; starting it over")
        runs[name] = done.get(name) if done.get(name) and not stale else run_once(name, run_cfg, cfg, stale)
    return runs


def val_curve(log_path: Path, flops_per_token: float, offset: float = 0.0) -> list[tuple[float, float]]:
    records = through_door(doors.run_log, log_path, True)
    return log_curves(records, lambda r: offset + r["tokens"] * flops_per_token).get("val_ce", [])


def lambada_scores(ckpt_path: str, texts: list[str], cfg: CompareConfig) -> dict:
    """eval.py's LAMBADA scoring of one checkpoint, in this process."""
    device = init_distributed(pick_device(cfg.device))  # under torchrun: this rank's GPU
    ckpt = load_checkpoint(ckpt_path, TrainConfig)
    model = checkpoint_model(ckpt, ckpt_path).to(device).eval()
    tokenizer = dataset_tokenizer(ckpt)
    r = score_lambada(model, tokenizer, texts, device=device, progress=True)
    return {"n": r["n"], "acc": r["acc"], "ppl": r["ppl"], "data": cfg.lambada}


def run_compare(cfg: CompareConfig) -> dict:
    """Train CE, then CWT and its head fine-tune on the same FLOP budget; score all three."""
    check_out_dir(cfg)
    texts = load_lambada(cfg.lambada) if cfg.lambada else None  # a bad file fails before any training
    cfg = with_quick(cfg)
    vocab = padded_vocab_size(load_meta(ensure_dataset(cfg.dataset, cfg.data_root))["vocab_size"])
    shape = build_model(cfg.preset, vocab, **{k: v for k, v in model_settings(cfg).items() if v is not None})
    tokens_per_iter = cfg.batch_size * cfg.block_size
    per_token = {loss: shape.flops_per_token(cfg.block_size, scored_columns(loss, vocab, tokens_per_iter))
                 for loss in ("ce", "cwt")}
    cwt_iters, ft_iters = solve_cwt_iters(cfg.ce_iters, per_token["ce"], per_token["cwt"],
                                          cfg.finetune_fraction)
    budget = cfg.ce_iters * tokens_per_iter * per_token["ce"]
    note(f"FLOP budget {budget:.3e}: CE {cfg.ce_iters} steps | CWT {cwt_iters} steps + fine-tune {ft_iters} "
         f"steps ({tokens_per_iter} tokens/step; {per_token['ce']:.3e} vs {per_token['cwt']:.3e} "
         "FLOPs/token)")
    root = Path(cfg.out_dir)
    plan = {"ce": pretrain_config(cfg, "ce", cfg.ce_iters, root / "ce"),
            "cwt": pretrain_config(cfg, "cwt", cwt_iters, root / "cwt"),
            "cwt-ft": finetune_config(cfg, root / "cwt" / "ckpt.safetensors", ft_iters, root / "cwt-ft")}
    runs = run_plan(plan, cfg)
    curves = {"ce": val_curve(root / "ce" / "log.jsonl", per_token["ce"]),
              "cwt": val_curve(root / "cwt" / "log.jsonl", per_token["cwt"]),
              "cwt-ft": val_curve(root / "cwt-ft" / "log.jsonl", per_token["ce"], runs["cwt"]["flops"])}
    lam = {name: (lambada_scores(run["ckpt"], texts, cfg) if texts and is_main_process()
                  else {"note": "skipped: no --lambada=FILE.jsonl" if not texts else "scored on rank 0"})
           for name, run in runs.items()}
    result = {"config": dataclasses.asdict(cfg), "vocab": vocab, "tokens_per_iter": tokens_per_iter,
              "flops_per_token": per_token, "budget_flops": budget,
              "iters": {"ce": cfg.ce_iters, "cwt": cwt_iters, "cwt-ft": ft_iters},
              "runs": {name: {"val_ce": run["val"]["val_ce"], "val_bpb": run["val"].get("val_bpb"),
                              "flops": run["flops"], "tokens": run["tokens"], "seconds": run["seconds"],
                              "lambada": lam[name]} for name, run in runs.items()},
              "curves": curves}
    if is_main_process():
        print(compare_table(result))
    return result


def compare_table(result: dict) -> str:
    labels = {"ce": "CE (tied head)", "cwt": "CWT, raw (scored with tied E)",
              "cwt-ft": "CWT + head fine-tune"}
    lines = ["| model | steps | tokens | training FLOPs | share of budget | wall-clock s | val CE | val bpb "
             "| LAMBADA acc / ppl |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        lam = run["lambada"]
        lam = f"{100 * lam['acc']:.1f}% / {format_metric(lam['ppl'], 0)}" if "acc" in lam else "-"
        lines.append(f"| {labels[name]} | {result['iters'][name]} | {run['tokens']:,} | {run['flops']:.3e} | "
                     f"{run['flops'] / result['budget_flops']:.3f} | {seconds(run['seconds'])} | "
                     f"{run['val_ce']:.4f} | {format_metric(run.get('val_bpb'), 4)} | {lam} |")
    notes = {run["lambada"].get("note") for run in result["runs"].values()} - {None}
    lines += [f"\nLAMBADA: {note}" for note in sorted(notes)]
    return "\n".join(lines)


def seconds(value: float | None) -> str:
    return "- (earlier)" if value is None else f"{value:.0f}"  # a run --resume skipped was timed before


def plot_compare(result: dict, path: str) -> None:
    names = {"ce": "CE", "cwt": "CWT (raw, tied E)", "cwt-ft": "CWT + LM-head fine-tune"}
    c = result["config"]
    plot_curves({names[name]: {"val_ce": points} for name, points in result["curves"].items()}, path,
                "training FLOPs (estimate)", f"{c['preset']} on {Path(c['dataset']).name}: equal compute",
                {"FLOP budget": result["budget_flops"]})


# ------------------------------- --vocab_sizes: CE vs CWT + fine-tune once per vocabulary size, scored in bits per byte

# settings a finished size may differ in (resume/overwrite: how to treat a size's own runs, if compare.py has them)
SWEEP_UNCHECKED = ("out_dir", "json", "plot", "vocab_sizes", "resume", "overwrite", "negatives_sweep",
                   "negatives_batch_sizes", "seeds", "tensorboard", "wandb", "wandb_project", "wandb_run_name")


def run_vocab_sweep(cfg: CompareConfig) -> dict:
    """run_compare in out_dir/bpeN on the source tokenised with a BPE of each size, every model then scored on the
    whole validation split; a size whose result.json exists is skipped if made with the same settings."""
    from bpe import parse_bpe_name
    sizes = sorted(set(cfg.vocab_sizes))
    for n in sizes:
        parse_bpe_name(f"bpe:{n}")  # a bad size is one line before any work
    if cfg.dataset != "shakespeare" and (Path(cfg.dataset) / "meta.json").is_file():
        raise UserError(f"--vocab_sizes learns a tokenizer per size from a source's text; {cfg.dataset} is a prepared "
                        "dataset: pass its source (shakespeare, a Hugging Face id or local text files)")
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in SWEEP_UNCHECKED}
    folders = {n: Path(cfg.out_dir) / f"bpe{n}" for n in sizes}
    finished = resume_state(cfg, {n: (folder, {"bpe": n}) for n, folder in folders.items()}, settings, "size")
    results = []
    for n in sizes:
        done = folders[n] / "result.json"
        if n in finished:
            results.append(finished[n])
            note(f"bpe:{n}: finished earlier, skipped ({done})")
            continue
        start = time.time()
        data_dir = vocab_dataset(cfg, n)
        result = run_compare(dataclasses.replace(cfg, dataset=str(data_dir), out_dir=str(done.parent), json="",
                                                 plot="", vocab_sizes=[],
                                                 wandb_run_name=cfg.wandb_run_name and f"{cfg.wandb_run_name}/bpe{n}"))
        result["full_val"] = {name: full_val_scores(done.parent / name / "ckpt.safetensors", data_dir, result["config"])
                              for name in result["runs"]}
        if stopped := [f"{name} at step {s['step']} of {result['iters'][name]}"
                       for name, s in result["full_val"].items() if s["step"] < result["iters"][name]]:
            raise UserError(f"bpe:{n} was interrupted ({', '.join(stopped)}); run the same command again to redo "
                            "this size (finished sizes are skipped)")
        result.update(bpe=n, data_dir=str(data_dir), sweep_settings=settings, seconds=time.time() - start)
        if is_main_process():
            write_json(done, result)
        results.append(result)
    sweep = {"config": dataclasses.asdict(cfg), "sizes": results}
    if is_main_process():
        print(vocab_table(sweep))
    return sweep


def resume_state(cfg: CompareConfig, folders: dict, settings: dict, what: str) -> dict:
    """Before any work of a sweep: each finished size's or point's result.json (finished_size), by key; with
    --resume, the state of every run of the others through its door (run_state): damage anywhere is one line
    before the first run starts. `folders`: key -> (its folder, what its result.json must say it is)."""
    finished = {key: finished_size(folder / "result.json", settings, what, expected)
                for key, (folder, expected) in folders.items() if os.path.lexists(folder / "result.json")}
    for key, (folder, _) in folders.items():
        for run in RUNS if cfg.resume and key not in finished else ():
            run_state(folder / run)
    return finished


# What a finished point's or size's result.json holds, as compare.py reads it back on --resume (its door derives from
# these; what else a file holds is carried along, never read)
POSITIVE = {"range": (1, doors.BIG)}
COUNT = {"range": (0, doors.BIG)}


@dataclass
class LambadaScores:
    OTHERS: ClassVar[Any] = Any
    n: int = field(metadata=POSITIVE)
    acc: float = field(metadata={"range": (0, 1)})
    ppl: float = field(metadata={"range": (0, 1e300)})
    data: str


@dataclass
class ModelScores:
    OTHERS: ClassVar[Any] = Any
    val_ce: float
    val_bpb: float
    val_tokens: int = field(metadata=POSITIVE)
    val_bytes: int = field(metadata=POSITIVE)
    step: int = field(metadata=COUNT)
    tokens: int = field(metadata=COUNT)
    flops: float = field(metadata={"range": (0, 1e300)})
    seconds: float | None = field(metadata={"range": (0, 1e300)})
    lambada: LambadaScores | None = None


@dataclass
class PointResult:
    OTHERS: ClassVar[Any] = Any
    sweep_settings: dict[str, Any]
    seconds: float = field(metadata={"range": (0, 1e300)})
    steps: int = field(metadata=POSITIVE)
    ft_steps: int = field(metadata=COUNT)
    candidates: float = field(metadata={"range": (1, 1e300)})
    models: dict[str, ModelScores]


@dataclass
class SizeScores:
    OTHERS: ClassVar[Any] = Any
    val_ce: float
    val_bpb: float
    tokens: int = field(metadata=POSITIVE)
    bytes: int = field(metadata=POSITIVE)
    step: int = field(metadata=COUNT)


@dataclass
class SizeResult:
    OTHERS: ClassVar[Any] = Any
    sweep_settings: dict[str, Any]
    seconds: float = field(metadata={"range": (0, 1e300)})
    iters: dict[str, int] = field(metadata=POSITIVE)
    full_val: dict[str, SizeScores]


def finished_size(path: Path, settings: dict, what: str = "size", expected: dict | None = None) -> dict:
    """A size's (or a point's) result.json from an earlier run, through its door (doors.results_file: as SizeResult
    or PointResult declares it, and `expected`, what it is); refused when made with other settings."""
    result = through_door(doors.results_file, path, what, PointResult if what == "point" else SizeResult,
                          expected or {})
    runs = [["ce"], ["cwt", "cwt-ft"]] if what == "point" else [list(RUNS)]
    held = sorted(result["models" if what == "point" else "full_val"])
    if held not in runs or (what == "size" and sorted(result["iters"]) != held):
        raise UserError(f"{path} is not a finished {what}'s results: its runs are {doors.brief(held)}, not "
                        f"{' or '.join(' and '.join(r) for r in runs)}; delete it to run that {what} again")
    old = result["sweep_settings"]
    if changed := sorted(k for k in settings.keys() | old.keys() if settings.get(k) != old.get(k)):
        raise UserError(f"{path} was made with other settings ({', '.join(f'{k}={old.get(k)!r}' for k in changed)}); "
                        f"pass them again, another --out_dir, or delete {path.parent}")
    return result


def vocab_dataset(cfg: CompareConfig, n: int) -> Path:
    """The source tokenised with a BPE of n tokens learned from its training split, prepared on first use."""
    if cfg.dataset == "shakespeare":
        if is_main_process():
            ensure_dataset(f"shakespeare-bpe{n}", cfg.data_root)
        barrier()
        return ensure_dataset(f"shakespeare-bpe{n}", cfg.data_root)
    out = dataset_dir(cfg.dataset, cfg.data_root, tokenizer=f"bpe:{n}")
    if is_main_process() and not (out / "meta.json").is_file():
        prepare(PrepareConfig(dataset=cfg.dataset, tokenizer=f"bpe:{n}", data_root=cfg.data_root))
    barrier()
    return out


def full_val_scores(ckpt_path: Path, data_dir: Path, run_cfg: dict) -> dict:
    """val_ce and val_bpb of a checkpoint over every whole block of the validation split, in batches of about 4096
    tokens (which do not change the figures); the tokens and UTF-8 bytes scored, and its step."""
    device = init_distributed(pick_device(run_cfg["device"]))
    ckpt = load_checkpoint(ckpt_path, TrainConfig)
    model = checkpoint_model(ckpt, ckpt_path).to(device)
    block = run_cfg["block_size"]
    tokens = open_split(data_dir, "val", model.config.vocab_size)
    byte_counts = open_val_split(data_dir, model.config.vocab_size).byte_counts
    special = special_ids(load_meta(data_dir))
    val = evaluate(objective_of(ckpt, model, ckpt_path), ValSplit(tokens, byte_counts, special),
                   Validation(batch_size=max(1, 4096 // block), block_size=block, device=device,
                              dtype=pick_dtype(run_cfg["dtype"], device)))
    scored = (len(tokens) - 1) // block * block  # the targets of every whole block
    return {**val, "tokens": scored, "bytes": int(byte_counts[1:scored + 1].sum(dtype=np.int64)),
            "step": ckpt.state.step if ckpt.state else 0}


def vocab_table(sweep: dict) -> str:
    lines = ["| BPE V | val tokens | val bytes | bytes/token | steps CE / CWT + ft | val_bpb CE | val_bpb CWT raw "
             "| val_bpb CWT + ft | CWT + ft − CE | minutes |", "|" + "---|" * 10]
    for r in sweep["sizes"]:
        bpb = {name: s["val_bpb"] for name, s in r["full_val"].items()}
        ce = r["full_val"]["ce"]
        lines.append(f"| {r['bpe']:,} | {ce['tokens']:,} | {ce['bytes']:,} | {ce['bytes'] / ce['tokens']:.2f} | "
                     f"{r['iters']['ce']} / {r['iters']['cwt']} + {r['iters']['cwt-ft']} | {bpb['ce']:.4f} | "
                     f"{bpb['cwt']:.4f} | {bpb['cwt-ft']:.4f} | {bpb['cwt-ft'] - bpb['ce']:+.4f} | "
                     f"{r['seconds'] / 60:.1f} |")
    return "\n".join(lines + ["", "Bits per byte on the whole validation split: the same held-out documents (chosen "
                               "by a hash of their text) at every size. CE and CWT + fine-tune at equal training FLOPs "
                               "within each size; budgets differ across sizes."])


def plot_vocab_sweep(sweep: dict, path: str) -> None:
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, label, style in (("ce", "CE", "-"), ("cwt-ft", "CWT + LM-head fine-tune", "-"),
                               ("cwt", "CWT (raw, tied E)", ":")):
        pts = sorted((r["bpe"], r["full_val"][name]["val_bpb"]) for r in sweep["sizes"])
        ax.plot(*zip(*pts), style, marker="o", label=label)
    c = sweep["config"]
    ax.set(xscale="log", xlabel="vocabulary size (BPE tokens)", ylabel="validation bits per byte",
           title=f"{c['preset']} on {Path(c['dataset']).name}: equal compute at each size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


# --------- --negatives_sweep: how many negatives CWT needs, at a fixed batch (k sampled, unique, all) and by batch size

# settings a finished point may differ in: which points there are, and where the results go
POINT_UNCHECKED = (*SWEEP_UNCHECKED, "seed", "batch_size", "quick")


def run_negatives_sweep(cfg: CompareConfig) -> list[dict]:
    """Every point of the series (negatives_series) once per seed, the finished skipped; a row per series and point."""
    check_config(cfg)
    need_extra("bench", "--negatives_sweep")  # its variants, and the cost of a step
    from bench import parse_variant
    cfg = with_quick(cfg)
    series = negatives_series(cfg)
    seeds = cfg.seeds or [cfg.seed]
    points = [(b, v, s) for b, v in dict.fromkeys(p for pts in series.values() for p in pts) for s in seeds]
    root = Path(cfg.out_dir)
    check_points_folder(cfg, root, points)
    texts = load_lambada(cfg.lambada) if cfg.lambada else None  # a bad file fails before any training
    data_dir = ensure_dataset(cfg.dataset, cfg.data_root)
    vocab = padded_vocab_size(load_meta(data_dir)["vocab_size"])
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in POINT_UNCHECKED}
    finished = resume_state(cfg, {p: (point_dir(root, *p), dict(zip(("batch_size", "variant", "seed"), p)))
                                  for p in points}, settings, "point")
    results = {}
    for batch, variant, seed in points:
        done = point_dir(root, batch, variant, seed) / "result.json"
        if (batch, variant, seed) in finished:
            results[batch, variant, seed] = finished[batch, variant, seed]
            note(f"{done.parent.name}: finished earlier, skipped ({done})")
            continue
        point_cfg = dataclasses.replace(cfg, batch_size=batch, seed=seed)
        results[batch, variant, seed] = run_point(point_cfg, parse_variant(variant), done.parent, data_dir, vocab,
                                                  texts)
        results[batch, variant, seed].update(batch_size=batch, variant=variant, seed=seed, sweep_settings=settings)
        if is_main_process():
            write_json(done, results[batch, variant, seed])
    cost = negatives_cost(cfg, series, vocab) if is_main_process() else {}
    rows = [negatives_row(cfg, name, batch, variant, [(results[batch, variant, s], results[batch, "ce", s])
                                                      for s in seeds], cost.get((batch, variant), {}))
            for name, pts in series.items() for batch, variant in pts]
    if is_main_process():
        print(negatives_table(rows))
    return rows


def negatives_series(cfg: CompareConfig) -> dict[str, list[tuple[int, str]]]:
    """The points (batch size, bench.py variant) of each series; bad values refused in one line."""
    from bench import negatives_variants
    series = {}
    if cfg.negatives_sweep:
        variants = negatives_variants(cfg.negatives_sweep, cfg.batch_size * cfg.block_size)
        series["k"] = [(cfg.batch_size, v) for v in ("ce", *variants)]
    if cfg.negatives_batch_sizes:
        series["batch"] = [(b, v) for b in sorted(cfg.negatives_batch_sizes) for v in ("ce", "cwt")]
    return series


def point_dir(root: Path, batch: int, variant: str, seed: int) -> Path:
    return root / f"b{batch}-{variant}-s{seed}"


def check_points_folder(cfg: CompareConfig, root: Path, points: list[tuple[int, str, int]]) -> None:
    """Before any work: runs of an unfinished point are continued or started over only when asked."""
    if any(p.exists() and not p.is_dir() for p in (root, *root.parents)):
        raise UserError(f"--out_dir={root}: it, or a folder above it, is a file; pass a folder")
    held = [folder.name for folder in (point_dir(root, *p) for p in points) if not (folder / "result.json").exists()
            and any((folder / run / f).exists() for run in RUNS for f in ("ckpt.safetensors", "log.jsonl"))]
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{root} holds unfinished points of an earlier sweep ({', '.join(held)}); continue them with "
                        "--resume (same settings), start them over with --overwrite, or pick another --out_dir "
                        "(finished points are skipped either way)")


def run_point(cfg: CompareConfig, kw: dict, folder: Path, data_dir: Path, vocab: int,
              texts: list[str] | None) -> dict:
    """One point at cfg.batch_size and cfg.seed: CE, or CWT with the negatives `kw` (bench.parse_variant's) and its
    head fine-tune, on the same tokens; every model scored on the whole validation split (and LAMBADA, given texts)."""
    start = time.time()
    steps = cfg.ce_iters
    ft_steps = max(1, math.ceil(cfg.finetune_fraction * steps))
    if kw["loss"] == "ce":  # the same tokens as CWT and its fine-tune
        plan = {"ce": pretrain_config(cfg, "ce", steps + ft_steps, folder / "ce")}
    else:
        plan = {"cwt": pretrain_config(cfg, "cwt", steps, folder / "cwt", negatives=kw["negatives"],
                                       num_negatives=kw["num_negatives"]),
                "cwt-ft": finetune_config(cfg, folder / "cwt" / "ckpt.safetensors", ft_steps, folder / "cwt-ft")}
    runs = run_plan(plan, cfg)
    models = {}
    for name, run in runs.items():
        scores = full_val_scores(Path(run["ckpt"]), data_dir, dataclasses.asdict(cfg))
        models[name] = {"val_ce": scores["val_ce"], "val_bpb": scores["val_bpb"], "val_tokens": scores["tokens"],
                        "val_bytes": scores["bytes"], "step": scores["step"], "tokens": run["tokens"],
                        "flops": run["flops"], "seconds": run["seconds"]}
        if texts and is_main_process():
            models[name]["lambada"] = lambada_scores(run["ckpt"], texts, cfg)
    return {"steps": plan[next(iter(plan))].max_iters, "ft_steps": 0 if kw["loss"] == "ce" else ft_steps,
            "candidates": scored_candidates(cfg, kw, data_dir, vocab), "models": models,
            "seconds": time.time() - start}


def scored_candidates(cfg: CompareConfig, kw: dict, data_dir: Path, vocab: int) -> float:
    """What each position is scored against: V (CE), k + 1 (sampled), the batch's positions (all), or its
    distinct targets (unique: their mean over the run's micro-batches)."""
    if kw["loss"] == "ce":
        return vocab
    if kw["num_negatives"]:
        return kw["num_negatives"] + 1
    if kw["negatives"] == "all":
        return cfg.batch_size * cfg.block_size
    sampler = BatchSampler(open_split(data_dir, "train", vocab), cfg.batch_size, cfg.block_size, cfg.seed)
    return float(np.mean([sampler.get(i)[1].unique().numel() for i in range(cfg.ce_iters)]))


def negatives_cost(cfg: CompareConfig, series: dict, vocab: int) -> dict[tuple[int, str], dict]:
    """ms per step and peak extra memory of one pre-training step of each point's objective at its batch size:
    bench.py's interleaved timing of the study's shape (on Zipf-distributed tokens, not the dataset's)."""
    from bench import BenchConfig, run_bench
    by_batch = {}
    for batch, variant in dict.fromkeys(p for pts in series.values() for p in pts):
        by_batch.setdefault(batch, []).append(variant)
    cost = {}
    for batch, variants in sorted(by_batch.items()):
        tokens = batch * cfg.block_size
        result = run_bench(BenchConfig(mode="step", preset=cfg.preset, vocab=[vocab], step_tokens=[tokens],
                                       block_size=cfg.block_size, variants=variants, step_variants=variants,
                                       max_logits=2**62, warmup=0 if cfg.quick else 1, repeats=1 if cfg.quick else 5,
                                       device=cfg.device, dtype=cfg.dtype))
        for r in result["rows"]:
            cost[batch, r["variant"]] = {"step_ms": 1e3 * r["time_s"], "device": result["meta"]["device_name"],
                                         "peak_mib": None if r["memory_bytes"] is None else r["memory_bytes"] / 2**20}
    return cost


def negatives_row(cfg: CompareConfig, series: str, batch: int, variant: str, pairs: list[tuple[dict, dict]],
                  cost: dict) -> dict:
    """One point of a series over its seeds: (its result, CE's at the same batch and seed) for each seed."""
    from bench import negatives_label, parse_variant
    kw = parse_variant(variant)
    per_seed = [seed_scores(result, ce) for result, ce in pairs]
    first = pairs[0][0]
    row = dict(series=series, label=negatives_label(variant), variant=variant, loss=kw["loss"],
               negatives=None if kw["loss"] == "ce" else kw["negatives"], num_negatives=kw["num_negatives"],
               batch_size=batch, block_size=cfg.block_size,
               candidates=statistics.mean(r["candidates"] for r, _ in pairs),
               steps=first["steps"], ft_steps=first["ft_steps"], seeds=[p["seed"] for p in per_seed],
               tokens=first["models"]["ce" if kw["loss"] == "ce" else "cwt-ft"]["tokens"],
               flops=statistics.mean(p["flops"] for p in per_seed))
    for key in ("val_ce", "val_bpb", "bpb_vs_ce", "raw_val_ce", "raw_val_bpb", "raw_bpb_vs_ce", "lambada_acc"):
        row[key], row[f"{key}_std"] = mean_and_spread([p.get(key) for p in per_seed])
    row.update(step_ms=cost.get("step_ms"), peak_mib=cost.get("peak_mib"), cost_device=cost.get("device"),
               preset=cfg.preset, dataset=cfg.dataset, seconds=sum(r["seconds"] for r, _ in pairs),
               per_seed=per_seed)
    return row


def seed_scores(result: dict, ce: dict) -> dict:
    """One seed of a point: its final model's scores (CE, or CWT after the head fine-tune), the raw CWT model's,
    and both in bits per byte less CE's at the same batch size and seed."""
    models = result["models"]
    final = models.get("cwt-ft") or models["ce"]
    raw = models.get("cwt")
    ce_bpb = ce["models"]["ce"]["val_bpb"]
    scores = {"seed": result["seed"], "val_ce": final["val_ce"], "val_bpb": final["val_bpb"],
              "bpb_vs_ce": None if raw is None else final["val_bpb"] - ce_bpb, "tokens": final["tokens"],
              "flops": final["flops"], "seconds": result["seconds"]}
    if raw is not None:
        scores.update(raw_val_ce=raw["val_ce"], raw_val_bpb=raw["val_bpb"], raw_bpb_vs_ce=raw["val_bpb"] - ce_bpb)
    if "lambada" in final:
        scores["lambada_acc"] = final["lambada"]["acc"]
    return scores


def mean_and_spread(values: list[float | None]) -> tuple[float | None, float | None]:
    """The mean over seeds and their sample standard deviation (none from one seed, or a missing value)."""
    if not values or any(v is None for v in values):
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def negatives_table(rows: list[dict]) -> str:
    lambada = any(r["lambada_acc"] is not None for r in rows)
    head = ["series", "batch", "negatives", "candidates/row", "tokens", "FLOPs", "val CE", "val bpb", "bpb − CE",
            "raw bpb", "ms/step", "peak MiB", "minutes", *(["LAMBADA acc"] if lambada else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["series"], f"{r['batch_size']} x {r['block_size']}", r["label"], f"{r['candidates']:,.0f}",
                 f"{r['tokens']:,}", f"{r['flops']:.3e}", *(spread(r, key) for key in ("val_ce", "val_bpb",
                                                                                      "bpb_vs_ce", "raw_val_bpb")),
                 format_metric(r["step_ms"], 1), format_metric(r["peak_mib"], 1), f"{r['seconds'] / 60:.1f}",
                 *([spread(r, "lambada_acc")] if lambada else [])]
        lines.append("| " + " | ".join(cells) + " |")
    seeds = rows[0]["seeds"] if rows else []
    device = next((r["cost_device"] for r in rows if r["cost_device"]), "-")
    return "\n".join(lines + ["", f"Mean ± sample standard deviation over seeds {', '.join(map(str, seeds))} "
                              f"(n={len(seeds)}). val CE and val bpb on the whole validation split; CWT rows after "
                              "the head fine-tune (raw bpb: before it, scored with the tied E); bpb − CE: against "
                              "CE at the same batch size and seed, which trains on the same tokens. Series k: a "
                              "fixed batch; series batch: more tokens per step, as the paper's batch sizes. "
                              f"ms/step and peak MiB: one pre-training step of this shape (bench.py, {device})."])


def spread(row: dict, key: str) -> str:
    """A row's mean over seeds, ± their standard deviation when there are several; differences signed."""
    mean = row[key]
    std = row[f"{key}_std"]
    if mean is None:
        return "-"
    shown = f"{mean:+.4f}" if key.endswith("_vs_ce") else f"{mean:.4f}"
    return shown if std is None else f"{shown} ± {std:.4f}"


def plot_negatives_sweep(rows: list[dict], path: str) -> None:
    """Two panels against the negatives scored per row (log x): bits per byte less CE's at the same batch
    (after the fine-tune, and raw), and the cost of a step (time, and memory on a second axis)."""
    plt = import_pyplot()
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(12, 4.4))
    memory = cost.twinx()
    for i, (name, title) in enumerate((("k", "fixed batch: k sampled, unique, all"),
                                       ("batch", "batch size grows (all)"))):
        mine = sorted((r for r in rows if r["series"] == name and r["loss"] == "cwt"), key=lambda r: r["candidates"])
        if not mine:
            continue
        x = [r["candidates"] - 1 for r in mine]
        quality.errorbar(x, [r["bpb_vs_ce"] for r in mine], yerr=[r["bpb_vs_ce_std"] or 0 for r in mine],
                         marker="o", capsize=3, color=f"C{i}", label=f"CWT + fine-tune, {title}")
        quality.plot(x, [r["raw_bpb_vs_ce"] for r in mine], ":", marker=".", color=f"C{i}",
                     label="raw CWT (before the fine-tune)" if i == 0 else None)
        for r, xi in zip(mine, x):  # the batch series' names below its points: `all` and B=... may coincide
            quality.annotate(r["label"] if name == "k" else f"B={r['batch_size']}", (xi, r["bpb_vs_ce"]),
                             textcoords="offset points", xytext=(4, 4 if name == "k" else -10), fontsize=7)
        timed = [(xi, r) for xi, r in zip(x, mine) if r["step_ms"] is not None]
        cost.plot([xi for xi, _ in timed], [r["step_ms"] for _, r in timed], marker="o", color=f"C{i}",
                  label=f"ms/step, {title}")
        measured = [(xi, r) for xi, r in timed if r["peak_mib"] is not None]
        memory.plot([xi for xi, _ in measured], [r["peak_mib"] for _, r in measured], "--", marker="s",
                    color=f"C{i}", label=f"peak MiB, {title}")
    quality.axhline(0, color="grey", lw=1, label="CE, same batch and tokens")
    quality.set(xscale="log", xlabel="negatives per row", ylabel="validation bits per byte − CE's")
    cost.set(xscale="log", xlabel="negatives per row", ylabel="ms per pre-training step")
    memory.set(ylabel="peak extra memory of a step (MiB)")
    cost.set_ylim(bottom=0)
    memory.set_ylim(bottom=0)
    for ax in (quality, cost):
        ax.grid(True, which="both", alpha=0.3)
    quality.legend(fontsize=7)
    handles = [h for ax in (cost, memory) for h in ax.get_legend_handles_labels()[0]]
    cost.legend(handles, [h.get_label() for h in handles], fontsize=7)
    if cwt := [r for r in rows if r["loss"] == "cwt"]:
        r = cwt[0]
        fig.suptitle(f"How many negatives CWT needs: {r['preset']} on {Path(r['dataset']).name}, {r['steps']} steps + "
                     f"{r['ft_steps']} of fine-tune, seeds {', '.join(map(str, r['seeds']))}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str]) -> None:
    cfg = parse_flags(CompareConfig, argv)
    check_config(cfg)
    declared_io(cfg, argv)
    if cfg.plot:
        import_pyplot(cfg.plot)  # fail before training, not after
    negatives = bool(cfg.negatives_sweep or cfg.negatives_batch_sizes)
    sweep = bool(cfg.vocab_sizes)
    result = run_negatives_sweep(cfg) if negatives else run_vocab_sweep(cfg) if sweep else run_compare(cfg)
    plot = plot_negatives_sweep if negatives else plot_vocab_sweep if sweep else plot_compare
    if is_main_process():  # under torchrun every rank trains; one writes
        save_results(result, cfg.json, cfg.plot, plot)


if __name__ == "__main__":
    run_main(main)

"""CE vs CWT at equal training compute: the paper's headline experiment, small enough for a CPU.

    python compare.py                   # tiny preset on Shakespeare: CE, then CWT + its LM-head fine-tune
    python compare.py --json=results/compare.json --plot=results/compare.png
    python compare.py --preset=pythia-70m --dataset=roneneldan/TinyStories --lambada=lambada.jsonl
    python compare.py --vocab_sizes=1024,4096,16384 --json=results/vocab.json --plot=results/vocab.png

CE trains for --ce_iters steps; that sets the FLOP budget (GPT.flops_per_token). CWT then trains for as
many steps as fit in the same budget once its LM-head fine-tune (2% of its tokens, at CE's cost per token)
is paid for. All three models are scored on validation CE and, with --lambada, on LAMBADA, in this process
with train.py's, finetune.py's and eval.py's own functions.

The runs live in out_dir/ce, out_dir/cwt and out_dir/cwt-ft. A second compare.py into an out_dir that holds
them is refused: --resume skips the runs that finished and continues an interrupted one (Ctrl-C stops
compare.py, with the run's checkpoint saved), --overwrite starts every run over.

--vocab_sizes=N1,N2,...: the same experiment once per vocabulary size, each with a byte-level BPE of N tokens
learned from the source's training split (the dataset prepared once, as data.py --tokenizer=bpe:N does it), in
out_dir/bpeN/. Every model is then scored in bits per byte on the whole validation split, which holds out the
same documents (chosen by a hash of their text) whatever the tokenizer: every size is scored on the same text.
Budgets are equal within a size, not across sizes (CE's cost grows with V). A size whose out_dir/bpeN/result.json
exists is skipped, so an interrupted sweep continues where it stopped. The paper compared vocabulary sizes on
GLUE with encoders (glue.py on encoders trained per size is its version); this decoder sweep is our extension.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import (
    DeviceName,
    DtypeName,
    UserError,
    barrier,
    checkpoint_model,
    in_range,
    init_distributed,
    is_main_process,
    load_checkpoint,
    parse_flags,
    pick_device,
    pick_dtype,
    run_main,
)
from data import (
    PrepareConfig,
    dataset_dir,
    dataset_tokenizer,
    ensure_dataset,
    load_meta,
    open_split,
    open_val_bytes,
    prepare,
    special_ids,
)
from eval import load_lambada, score_lambada
from finetune import FinetuneConfig, finetune
from loss import scored_columns
from model import PresetName, build_model, padded_vocab_size
from results import check_output_path, format_metric, import_pyplot, save_figure, save_results, write_json
from train import TrainConfig, evaluate, note, train


@dataclass
class CompareConfig:
    preset: PresetName = "tiny"
    dataset: str = "shakespeare"
    data_root: str = "data"
    block_size: int = 128
    batch_size: int = 8
    ce_iters: int = 240  # length of the CE run: sets the FLOP budget both models get
    finetune_fraction: float = 0.02  # CWT's head fine-tune, in pre-training tokens (paper: 2%)
    lr: float = 1e-3
    warmup_fraction: float = 0.1
    evals: int = 6  # validation points per pre-training run
    eval_batches: int = 4
    lambada: str = ""  # LAMBADA .jsonl for eval.py; skipped when empty
    out_dir: str = "out-compare"
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    seed: int = 1337
    json: str = ""
    plot: str = ""
    quick: bool = False  # a few steps, for tests
    resume: bool = False  # skip the runs in out_dir that finished; continue an interrupted one
    overwrite: bool = False  # start every run in out_dir over
    vocab_sizes: list[int] = dataclasses.field(default_factory=list)  # BPE sizes: one experiment per size


RUNS = ("ce", "cwt", "cwt-ft")  # out_dir's folders, in the order they run
# What makes a run in out_dir the one this compare.py plans (data_root, device and dtype may change).
SAME_RUN = ("dataset", "preset", "block_size", "batch_size", "loss", "lr", "min_lr", "warmup_iters", "seed",
            "max_iters")


def check_config(cfg: CompareConfig) -> None:
    for name in ("batch_size", "ce_iters", "evals", "eval_batches"):
        in_range(cfg, name, 1)
    in_range(cfg, "block_size", 2)
    in_range(cfg, "finetune_fraction", 0, 1, "(]")
    in_range(cfg, "lr", 0, ends="(]")
    in_range(cfg, "warmup_fraction", 0, 1)
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume continues the runs in --out_dir and --overwrite starts them over: pass one")


def check_out_dir(cfg: CompareConfig) -> None:
    """Before any work: an out_dir holding an earlier compare.py's runs is continued (--resume) or started
    over (--overwrite) only when asked, never replaced by default."""
    root = Path(cfg.out_dir)
    if any(p.exists() and not p.is_dir() for p in (root, *root.parents)):
        raise UserError(f"--out_dir={root}: it, or a folder above it, is a file; pass a folder")
    held = [name for name in RUNS if (root / name / "ckpt.pt").exists() or (root / name / "log.jsonl").exists()]
    if held and not (cfg.resume or cfg.overwrite):
        raise UserError(f"{root} holds the runs of an earlier compare.py ({', '.join(held)}); continue them with "
                        "--resume (same settings), start every run over with --overwrite, or pick another --out_dir")


def finished_run(run_cfg: TrainConfig) -> dict | None:
    """With --resume: the summary of a run in its folder that reached its planned steps (read from its
    checkpoint: it is skipped), else None (train.py's --resume continues it, or it starts). A run of other
    settings is another experiment: refused."""
    path = Path(run_cfg.out_dir) / "ckpt.pt"
    if not path.is_file():
        return None
    ckpt = load_checkpoint(path)
    before = ckpt.get("train_config") or {}
    for key in SAME_RUN:
        planned = getattr(run_cfg, key)
        if planned is not None and key in before and before[key] != planned:
            raise UserError(f"{path.parent} holds a run with {key}={before[key]!r} but this compare.py plans "
                            f"{key}={planned!r}; resume with that run's settings, start over with --overwrite, or "
                            "pick another --out_dir")
    if ckpt.get("step") != run_cfg.max_iters:
        return None
    note(f"{path.parent}: finished earlier ({ckpt['step']} steps); skipped")
    return {"step": ckpt["step"], "val": ckpt.get("val"), "first_val": ckpt.get("first_val"),
            "loss": ckpt.get("loss"), "ckpt": str(path), "interrupted": False, "seconds": None,
            "tokens": ckpt.get("base_tokens", 0) + ckpt.get("tokens_seen", 0),
            "flops": ckpt.get("base_flops", 0.0) + ckpt.get("flops", 0.0)}


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
    """One run in its folder: with --resume, continued from its checkpoint (train.py's --resume=auto: a
    folder without one starts); with --overwrite or `start_over`, started over; else a fresh folder."""
    resume = "auto" if cfg.resume and not start_over else False
    run_cfg = dataclasses.replace(run_cfg, resume=resume, overwrite=cfg.overwrite or start_over)
    summary = finetune(run_cfg) if isinstance(run_cfg, FinetuneConfig) else train(run_cfg)
    if summary["interrupted"]:  # Ctrl-C or SIGTERM: the run saved its checkpoint; the next ones wait
        note(f"compare.py stopped during {name}; continue it with the same settings and --resume")
        raise KeyboardInterrupt
    return summary


def val_curve(log_path: Path, flops_per_token: float, offset: float = 0.0) -> list[tuple[float, float]]:
    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return [(offset + r["tokens"] * flops_per_token, r["val_ce"]) for r in recs if "val_ce" in r]


def lambada_scores(ckpt_path: str, texts: list[str], cfg: CompareConfig) -> dict:
    """eval.py's LAMBADA scoring of one checkpoint, in this process."""
    device = init_distributed(pick_device(cfg.device))  # under torchrun: this rank's GPU
    ckpt = load_checkpoint(ckpt_path)
    model = checkpoint_model(ckpt, ckpt_path).to(device).eval()
    tokenizer = dataset_tokenizer(ckpt)
    r = score_lambada(model, tokenizer, texts, device=device, progress=True)
    return {"n": r["n"], "acc": r["acc"], "ppl": r["ppl"], "data": cfg.lambada}


def run_compare(cfg: CompareConfig) -> dict:
    """Train CE, then CWT and its head fine-tune on the same FLOP budget; score all three."""
    check_out_dir(cfg)
    texts = load_lambada(cfg.lambada) if cfg.lambada else None  # a bad file fails before any training
    if cfg.quick:
        cfg = dataclasses.replace(cfg, block_size=32, batch_size=2, ce_iters=2, evals=1, eval_batches=1,
                                  finetune_fraction=0.1)
    vocab = padded_vocab_size(load_meta(ensure_dataset(cfg.dataset, cfg.data_root))["vocab_size"])
    shape = build_model(cfg.preset, vocab, block_size=cfg.block_size)
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
    shared = dict(dataset=cfg.dataset, data_root=cfg.data_root, preset=cfg.preset, block_size=cfg.block_size,
                  batch_size=cfg.batch_size, eval_batches=cfg.eval_batches, device=cfg.device,
                  dtype=cfg.dtype, seed=cfg.seed, log_interval=max(1, cfg.ce_iters // 10))
    plan = {name: TrainConfig(loss=loss, max_iters=iters, lr=cfg.lr, min_lr=cfg.lr / 10,
                              warmup_iters=max(1, round(cfg.warmup_fraction * iters)),
                              eval_interval=max(1, iters // cfg.evals), out_dir=str(root / name), **shared)
            for name, loss, iters in (("ce", "ce", cfg.ce_iters), ("cwt", "cwt", cwt_iters))}
    plan["cwt-ft"] = FinetuneConfig(ckpt=str(root / "cwt" / "ckpt.pt"), max_iters=ft_iters,
                                    warmup_iters=max(1, min(10, ft_iters // 5)),
                                    eval_interval=max(1, ft_iters // 2), out_dir=str(root / "cwt-ft"), **shared)
    done = {name: finished_run(run_cfg) for name, run_cfg in plan.items()} if cfg.resume else {}
    runs = {}
    for name, run_cfg in plan.items():
        held = any((root / name / f).exists() for f in ("ckpt.pt", "log.jsonl"))
        stale = name == "cwt-ft" and cfg.resume and not done["cwt"] and held
        if stale:  # it fine-tuned an earlier state of cwt, trained further just now
            note(f"{root / name}: it fine-tuned an earlier state of {root / 'cwt'}; starting it over")
        runs[name] = done.get(name) if done.get(name) and not stale else run_once(name, run_cfg, cfg, stale)
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
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = {"ce": "CE", "cwt": "CWT (raw, tied E)", "cwt-ft": "CWT + LM-head fine-tune"}
    for name, pts in result["curves"].items():
        ax.plot(*zip(*pts), marker="o", ms=3, label=names[name])
    ax.axvline(result["budget_flops"], color="grey", ls="--", lw=1, label="FLOP budget")
    c = result["config"]
    ax.set(xlabel="training FLOPs (estimate)", ylabel="validation cross-entropy (nats/token)",
           title=f"{c['preset']} on {Path(c['dataset']).name}: equal compute")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# --vocab_sizes: CE vs CWT + fine-tune once per vocabulary size, scored in bits per byte

# settings a finished size may differ in (resume/overwrite: how to treat a size's own runs, if compare.py has them)
SWEEP_UNCHECKED = ("out_dir", "json", "plot", "vocab_sizes", "resume", "overwrite")


def run_vocab_sweep(cfg: CompareConfig) -> dict:
    """run_compare on the source tokenised with a BPE of each size, in out_dir/bpeN; then every model scored on
    the whole validation split (val_ce, val_bpb). A size whose result.json (written atomically once the size is
    done) exists is skipped, if it was made with the same settings."""
    from bpe import parse_bpe_name

    sizes = sorted(set(cfg.vocab_sizes))
    for n in sizes:
        parse_bpe_name(f"bpe:{n}")  # a bad size is one line before any work
    if cfg.dataset != "shakespeare" and (Path(cfg.dataset).expanduser() / "meta.json").is_file():
        raise UserError(f"--vocab_sizes learns a tokenizer per size from a source's text; {cfg.dataset} is a prepared "
                        "dataset: pass its source (shakespeare, a Hugging Face id or local text files)")
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in SWEEP_UNCHECKED}
    results = []
    for n in sizes:
        done = Path(cfg.out_dir) / f"bpe{n}" / "result.json"
        if done.is_file():
            results.append(finished_size(done, settings))
            note(f"bpe:{n}: finished earlier, skipped ({done})")
            continue
        start = time.time()
        data_dir = vocab_dataset(cfg, n)
        result = run_compare(dataclasses.replace(cfg, dataset=str(data_dir), out_dir=str(done.parent), json="",
                                                 plot="", vocab_sizes=[]))
        result["full_val"] = {name: full_val_scores(done.parent / name / "ckpt.pt", data_dir, result["config"])
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


def finished_size(path: Path, settings: dict) -> dict:
    """A size's result.json from an earlier run, refused when made with other settings."""
    try:
        result = json.loads(path.read_text())
        old = result["sweep_settings"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise UserError(f"{path} is not a finished size's results; delete it to run that size again") from None
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
    """val_ce and val_bpb of a checkpoint over every whole block of the validation split (the last partial
    block aside), in batches of about 4096 tokens (which do not change the figures); the tokens and UTF-8
    bytes scored, and the checkpoint's step."""
    device = init_distributed(pick_device(run_cfg["device"]))
    ckpt = load_checkpoint(ckpt_path)
    model = checkpoint_model(ckpt, ckpt_path).to(device)
    block = run_cfg["block_size"]
    tokens = open_split(data_dir, "val", model.config.vocab_size)
    byte_counts = open_val_bytes(data_dir)
    val = evaluate(model, tokens, max(1, 4096 // block), block, device, pick_dtype(run_cfg["dtype"], device),
                   byte_counts=byte_counts, special=special_ids(load_meta(data_dir)))
    scored = (len(tokens) - 1) // block * block  # the targets of every whole block
    return {**val, "tokens": scored, "bytes": int(byte_counts[1:scored + 1].sum(dtype=np.int64)),
            "step": ckpt["step"]}


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
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str]) -> None:
    cfg = parse_flags(CompareConfig, argv)
    check_config(cfg)
    for path, flag in ((cfg.json, "json"), (cfg.plot, "plot")):
        if path:
            check_output_path(path, flag)
    if cfg.plot:
        import_pyplot()  # fail before training, not after
    sweep = bool(cfg.vocab_sizes)
    result = run_vocab_sweep(cfg) if sweep else run_compare(cfg)
    if is_main_process():  # under torchrun every rank trains; one writes
        save_results(result, cfg.json, cfg.plot, plot_vocab_sweep if sweep else plot_compare)


if __name__ == "__main__":
    run_main(main)

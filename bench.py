"""Speed and memory of cross-entropy vs Contrastive Weight Tying, and an equal-compute training run.

    python bench.py                     # loss layer + full training step, V = 8k..256k, CE vs CWT variants
    python bench.py --quick             # a small grid, under a minute on CPU
    python bench.py --mode=step --preset=pythia-70m --vocab=50304 --step_tokens=512 --repeats=9
    python bench.py --json=results/bench.json --plot=results/bench.png
    python bench.py compare             # CE vs CWT (+ its LM-head fine-tune) at equal training FLOPs
    python bench.py compare --preset=pythia-70m --dataset=roneneldan/TinyStories --lambada=lambada.jsonl

Speed: every variant of one configuration shares the same inputs and is timed in turn (A B C A B C ...)
so machine noise hits all of them alike; time per step is the median after warm-up. `loss` rows time
the objective alone (forward + backward from fixed hidden states (N, d) and the embedding E (V, d));
`step` rows time a whole training step of the preset (hidden states, loss, backward, clipping, AdamW).
Memory: the extra memory one step needs once warmed up (inputs, weights and optimizer state excluded).
On CUDA, the peak allocated minus what was allocated before the step. On CPU, each configuration runs in a
fresh subprocess that, for each variant, takes one warm-up step, resets its peak resident set (VmHWM, via
/proc/self/clear_refs) and reports the peak during one more step minus the resident set before it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from data import UserError, atomic_write_text, parse_flags, run_main
from loss import training_loss
from model import PRESETS, build_model, padded_vocab_size
from train import TrainConfig, autocast_context, head_columns, peak_flops, pick_device, pick_dtype

MEMORY_NOTE = {"cuda": "peak allocated during one step (after a warm-up step) minus the memory allocated before it",
               "cpu": "in a fresh subprocess per configuration, after a warm-up step: peak RSS (VmHWM) during one more step minus "
                      "the RSS before it (inputs, weights and optimizer state excluded)"}


@dataclass
class BenchConfig:
    mode: Literal["both", "loss", "step"] = "both"
    preset: Literal["tiny", "pythia-70m", "gpt2-124m"] = "pythia-70m"  # shape (d) for both kinds of rows
    vocab: list[int] = field(default_factory=lambda: [8192, 32768, 50304, 100352, 256000])
    tokens: list[int] = field(default_factory=lambda: [256, 1024])  # tokens per micro-batch, loss rows
    variants: list[str] = field(default_factory=lambda: ["ce", "cwt", "cwt-unique", "cwt-k256"])
    step_tokens: list[int] = field(default_factory=lambda: [256])  # tokens per micro-batch, step rows
    step_variants: list[str] = field(default_factory=lambda: ["ce", "cwt"])
    block_size: int = 256  # step rows: sequences of this length, batch = tokens // block_size
    max_logits: int = 1 << 26  # skip configurations whose CE logits (tokens x V) exceed this
    warmup: int = 1
    repeats: int = 3
    memory: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    seed: int = 0
    json: str = ""
    plot: str = ""
    quick: bool = False


QUICK = dict(preset="tiny", vocab=[8192, 50304], tokens=[512], variants=["ce", "cwt", "cwt-unique", "cwt-k128"],
             step_tokens=[512], repeats=3)


def parse_variant(name: str) -> dict:
    """'ce', 'cwt', 'cwt-unique', 'cwt-k256', 'cwt-unique-k256' -> training_loss keyword arguments;
    a '-chunkN' suffix (ce-chunk256, cwt-chunk1024) computes the loss N rows at a time."""
    m = re.fullmatch(r"(ce|cwt)(-unique)?(?:-k(\d+))?(?:-chunk([1-9]\d*))?", name)
    if not m or (m.group(1) == "ce" and (m.group(2) or m.group(3))):
        raise UserError(f"unknown variant {name!r}; use ce, cwt, cwt-unique, cwt-kN or cwt-unique-kN, "
                        "each optionally followed by -chunkN")
    return dict(loss=m.group(1), negatives="unique" if m.group(2) else "all",
                num_negatives=int(m.group(3)) if m.group(3) else None,
                chunk_size=int(m.group(4)) if m.group(4) else None)


def columns(variant: str, vocab: int, targets: torch.Tensor) -> int:
    """Output vectors each position is scored against: V for CE, N (U distinct with -unique) for CWT,
    at most k + 1 with -kN. The head FLOPs of a step are 6 * tokens * d * columns."""
    v = parse_variant(variant)
    if v["loss"] == "ce":
        return vocab
    pool = int(targets.unique().numel()) if v["negatives"] == "unique" else targets.numel()
    return min(v["num_negatives"] + 1, pool) if v["num_negatives"] else pool


def zipf_tokens(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids with Zipf(1) frequencies (id = frequency rank), so repeats in a batch look like text."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


# ----------------------------------------------------------------------------------------------
# One configuration: set-up, step function and FLOPs


def make_case(spec: dict, device: torch.device, dtype: torch.dtype):
    """Build the inputs for one configuration; returns ({variant: step_fn}, {variant: flops}, extra).

    spec: kind ("loss" | "step"), preset, vocab, tokens, block_size, variants, seed.
    """
    gen = torch.Generator().manual_seed(spec["seed"])
    vocab, tokens, variants = spec["vocab"], spec["tokens"], spec["variants"]
    loss_rng = torch.Generator()
    if spec["kind"] == "loss":
        d = PRESETS[spec["preset"]]["d_model"]
        h = (torch.randn(tokens, d, generator=gen)).to(device).requires_grad_()
        emb = (0.02 * torch.randn(vocab, d, generator=gen)).to(device).requires_grad_()
        targets = zipf_tokens(tokens, vocab, gen).to(device)

        def make(variant):
            kw = parse_variant(variant)

            def step():
                with autocast_context(device, dtype):
                    loss = training_loss(h, targets, emb, emb, generator=loss_rng, **kw)
                loss.backward()
                h.grad = emb.grad = None
            return step
        flops = {v: 6 * tokens * d * columns(v, vocab, targets) for v in variants}
        return {v: make(v) for v in variants}, flops, {"d_model": d}

    block = min(spec["block_size"], tokens)
    if tokens % block:
        raise UserError(f"step tokens {tokens} must be a multiple of --block_size={block}")
    torch.manual_seed(spec["seed"])
    model = build_model(spec["preset"], vocab, block_size=block).to(device)
    optimizer = model.configure_optimizer(1e-4, 0.1, (0.9, 0.95))
    seq = zipf_tokens(tokens // block * (block + 1), vocab, gen).view(-1, block + 1).to(device)
    x, y = seq[:, :-1], seq[:, 1:]

    def make(variant):
        kw = parse_variant(variant)

        def step():
            with autocast_context(device, dtype):
                loss = training_loss(model.hidden(x), y, model.wte.weight, model.output_weight,
                                     generator=loss_rng, **kw)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step
    flops = {v: tokens * model.flops_per_token(block, columns(v, vocab, y.reshape(-1))) for v in variants}
    return {v: make(v) for v in variants}, flops, {"d_model": model.config.d_model, "block_size": block,
                                                   "batch_size": tokens // block}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict, warmup: int, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each step function, measured in turn (A B C A B C ...) after warm-up."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def step_memory(spec: dict) -> dict[str, int | None]:
    """Extra bytes one warmed-up step of each variant needs (see MEMORY_NOTE); on CPU in a fresh process."""
    device = pick_device(spec["device"])
    steps, _, _ = make_case(spec, device, pick_dtype(spec["dtype"], device))
    memory = {}
    for name, fn in steps.items():
        fn()  # warm-up: allocates the optimizer state, which then belongs to the baseline
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            sync(device)
            memory[name] = torch.cuda.max_memory_allocated(device) - base
            continue
        base = _proc_status_kib("VmRSS")
        try:  # reset the high-water mark VmHWM to the current RSS (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return {name: None for name in steps}  # no honest way to isolate a step: no figure
        fn()
        peak = _proc_status_kib("VmHWM")
        memory[name] = None if base is None or peak is None else 1024 * max(0, peak - base)
    return memory


def measure_memory(spec: dict, device: torch.device) -> dict[str, int | None]:
    if device.type == "cuda":
        return step_memory(spec)
    # Every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed, so RSS
    # follows the live tensors (not memory glibc keeps for reuse) and variants can share one process.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_mem", json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"memory run failed for {spec}: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return {name: None for name in spec["variants"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# The grid


def run_bench(cfg: BenchConfig) -> dict:
    """Measure every configuration of the grid; returns {"meta": ..., "rows": [...]}."""
    if cfg.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    for v in cfg.variants + cfg.step_variants:
        parse_variant(v)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    peak = peak_flops(device)
    grid = []
    if cfg.mode in ("both", "loss"):
        grid += [("loss", v, n, cfg.variants) for v in cfg.vocab for n in cfg.tokens]
    if cfg.mode in ("both", "step"):
        grid += [("step", v, n, cfg.step_variants) for v in cfg.vocab for n in cfg.step_tokens]
    rows, skipped = [], []
    for kind, vocab, tokens, variants in grid:
        if tokens * vocab > cfg.max_logits:
            skipped.append(f"{kind} V={vocab} N={tokens}")
            continue
        spec = dict(kind=kind, preset=cfg.preset, vocab=vocab, tokens=tokens, block_size=cfg.block_size,
                    variants=variants, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
        steps, flops, extra = make_case(spec, device, dtype)
        times = time_interleaved(steps, cfg.warmup, cfg.repeats, device)
        del steps
        memory = measure_memory(spec, device) if cfg.memory else {v: None for v in variants}
        for v in variants:
            rows.append(summarize(dict(kind=kind, variant=v, preset=cfg.preset, vocab=vocab, tokens=tokens,
                                       **extra, times_s=times[v], flops=flops[v], memory_bytes=memory[v]),
                                  times[variants[0]], memory[variants[0]], peak))
        print(f"measured {kind} V={vocab} N={tokens}: " + ", ".join(
            f"{r['variant']} {1e3 * r['time_s']:.1f} ms" for r in rows[-len(variants):]), file=sys.stderr)
    meta = dict(device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"CPU, {torch.get_num_threads()} threads", dtype=str(dtype).removeprefix("torch."),
                torch=torch.__version__, repeats=cfg.repeats, warmup=cfg.warmup, memory=MEMORY_NOTE[device.type],
                ratios=f"relative to the first variant ({(cfg.variants + cfg.step_variants)[0]}) of the same row",
                skipped=skipped, config=dataclasses.asdict(cfg))
    return {"meta": meta, "rows": rows}


def summarize(row: dict, base_times: list[float], base_memory: int | None, peak: float | None) -> dict:
    """Add the derived figures: median and best (minimum) time, throughput, and ratios to the base variant.
    The best time is the least disturbed by other work on a shared machine."""
    t, best = statistics.median(row["times_s"]), min(row["times_s"])
    mem = row["memory_bytes"]
    return {**row, "time_s": t, "best_s": best, "tokens_per_s": row["tokens"] / t, "flops_per_s": row["flops"] / t,
            "mfu": row["flops"] / t / peak if peak else None, "time_ratio": t / statistics.median(base_times),
            "best_ratio": best / min(base_times),
            "memory_ratio": mem / base_memory if mem is not None and base_memory else None}


def markdown_table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    mfu = any(r["mfu"] is not None for r in rows)
    head = ["kind", "V", "tokens", "variant", "ms/step", "tokens/s", "time ×CE", "best ms", "best ×CE",
            "memory MiB", "memory ×CE", "GFLOP/step", "MFU" if mfu else "GFLOP/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mem = "-" if r["memory_bytes"] is None else f"{r['memory_bytes'] / 2**20:,.1f}"
        mratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
        last = f"{100 * r['mfu']:.1f}%" if mfu and r["mfu"] is not None else f"{r['flops_per_s'] / 1e9:,.1f}"
        lines.append(f"| {r['kind']} | {r['vocab']:,} | {r['tokens']:,} | {r['variant']} | {1e3 * r['time_s']:,.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['time_ratio']:.3f} | {1e3 * r['best_s']:,.1f} | {r['best_ratio']:.3f} | {mem} | {mratio} | {r['flops'] / 1e9:,.2f} | {last} |")
    notes = [f"{meta['device_name']}, {meta['dtype']}, torch {meta['torch']}; median (and best) of {meta['repeats']} "
             f"interleaved steps after {meta['warmup']} warm-up; shape {rows[0]['preset'] if rows else '-'}.",
             f"memory: {meta['memory']}.", f"ratios: {meta['ratios']}."]
    if meta["skipped"]:
        notes.append("skipped (tokens x V above --max_logits): " + ", ".join(meta["skipped"]))
    return "\n".join(lines + [""] + notes)


def import_pyplot():
    """matplotlib is an optional extra: a clear one-line UserError without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    return plt


def plot_bench(result: dict, path: str) -> None:
    plt = import_pyplot()
    kinds = [k for k in ("loss", "step") if any(r["kind"] == k for r in result["rows"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        for key in sorted({(r["variant"], r["tokens"]) for r in rows}, key=lambda k: (k[1], k[0])):
            pts = sorted((r["vocab"], 1e3 * r["time_s"]) for r in rows if (r["variant"], r["tokens"]) == key)
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]}, {key[1]} tokens")
        ax.set(xscale="log", yscale="log", xlabel="vocabulary size V", ylabel="ms per step",
               title=f"{'loss layer (fwd+bwd)' if kind == 'loss' else 'full training step'}, {rows[0]['preset']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(result["meta"]["device_name"], fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def write_json(obj: dict, path: str) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, default=str) + "\n")
    print(f"results written to {path}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Equal-compute comparison


@dataclass
class CompareConfig:
    preset: Literal["tiny", "pythia-70m", "gpt2-124m"] = "tiny"
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
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    seed: int = 1337
    json: str = ""
    plot: str = ""
    quick: bool = False  # a few steps, for tests


def solve_cwt_iters(ce_iters: int, ce_flops_per_token: float, cwt_flops_per_token: float,
                    fraction: float) -> tuple[int, int]:
    """CWT pre-training steps n and fine-tune steps ceil(fraction * n) (same tokens per step) such that
    n * cwt + ft * ce <= ce_iters * ce FLOPs per token, with n as large as possible."""
    budget = ce_iters * ce_flops_per_token
    cost = lambda n: n * cwt_flops_per_token + max(1, math.ceil(fraction * n)) * ce_flops_per_token  # noqa: E731
    n = max(1, int(budget / (cwt_flops_per_token + fraction * ce_flops_per_token)) + 1)
    while n > 1 and cost(n) > budget:
        n -= 1
    return n, max(1, math.ceil(fraction * n))


def val_curve(log_path: Path, flops_per_token: float, offset: float = 0.0) -> list[tuple[float, float]]:
    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return [(offset + r["tokens"] * flops_per_token, r["val_ce"]) for r in recs if "val_ce" in r]


def lambada_scores(ckpt: str, data: str, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "eval.py"), f"--ckpt={ckpt}", "--task=lambada", f"--data={data}", f"--json={out}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"note": f"eval.py failed: {res.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.read_text())


def run_compare(cfg: CompareConfig) -> dict:
    from data import ensure_dataset, load_meta
    from finetune import FinetuneConfig, finetune
    from train import train
    if cfg.quick:
        cfg = dataclasses.replace(cfg, block_size=32, batch_size=2, ce_iters=2, evals=1, eval_batches=1,
                                  finetune_fraction=0.1)
    vocab = padded_vocab_size(load_meta(ensure_dataset(cfg.dataset, cfg.data_root))["vocab_size"])
    shape = build_model(cfg.preset, vocab, block_size=cfg.block_size)
    tokens_per_iter = cfg.batch_size * cfg.block_size
    fpt = {loss: shape.flops_per_token(cfg.block_size, head_columns(TrainConfig(loss=loss), vocab, tokens_per_iter))
           for loss in ("ce", "cwt")}
    cwt_iters, ft_iters = solve_cwt_iters(cfg.ce_iters, fpt["ce"], fpt["cwt"], cfg.finetune_fraction)
    budget = cfg.ce_iters * tokens_per_iter * fpt["ce"]
    print(f"FLOP budget {budget:.3e}: CE {cfg.ce_iters} steps | CWT {cwt_iters} steps + fine-tune {ft_iters} "
          f"steps ({tokens_per_iter} tokens/step; {fpt['ce']:.3e} vs {fpt['cwt']:.3e} FLOPs/token)", file=sys.stderr)
    root = Path(cfg.out_dir)
    common = dict(dataset=cfg.dataset, data_root=cfg.data_root, preset=cfg.preset, block_size=cfg.block_size,
                  batch_size=cfg.batch_size, eval_batches=cfg.eval_batches, device=cfg.device, dtype=cfg.dtype,
                  seed=cfg.seed, log_interval=max(1, cfg.ce_iters // 10))
    runs = {}
    for name, loss, iters in (("ce", "ce", cfg.ce_iters), ("cwt", "cwt", cwt_iters)):
        shutil.rmtree(root / name, ignore_errors=True)
        run_cfg = TrainConfig(loss=loss, max_iters=iters, lr=cfg.lr, min_lr=cfg.lr / 10,
                              warmup_iters=max(1, round(cfg.warmup_fraction * iters)),
                              eval_interval=max(1, iters // cfg.evals), out_dir=str(root / name), **common)
        runs[name] = train(run_cfg)
    shutil.rmtree(root / "cwt-ft", ignore_errors=True)
    ft_cfg = FinetuneConfig(ckpt=runs["cwt"]["ckpt"], max_iters=ft_iters, warmup_iters=max(1, min(10, ft_iters // 5)),
                            eval_interval=max(1, ft_iters // 2), out_dir=str(root / "cwt-ft"), **common)
    runs["cwt-ft"] = finetune(ft_cfg)
    curves = {"ce": val_curve(root / "ce" / "log.jsonl", fpt["ce"]),
              "cwt": val_curve(root / "cwt" / "log.jsonl", fpt["cwt"]),
              "cwt-ft": val_curve(root / "cwt-ft" / "log.jsonl", fpt["ce"], runs["cwt"]["flops"])}
    lam = {}
    for name, run in runs.items():
        lam[name] = lambada_scores(run["ckpt"], cfg.lambada, root / f"lambada-{name}.json") if cfg.lambada \
            else {"note": "skipped: no --lambada=FILE.jsonl"}
    result = {"config": dataclasses.asdict(cfg), "vocab": vocab, "tokens_per_iter": tokens_per_iter,
              "flops_per_token": fpt, "budget_flops": budget, "iters": {"ce": cfg.ce_iters, "cwt": cwt_iters,
                                                                         "cwt-ft": ft_iters},
              "runs": {name: {"val_ce": run["val"]["val_ce"], "flops": run["flops"], "tokens": run["tokens"],
                              "seconds": run["seconds"], "lambada": lam[name]} for name, run in runs.items()},
              "curves": curves}
    print(compare_table(result))
    return result


def compare_table(result: dict) -> str:
    labels = {"ce": "CE (tied head)", "cwt": "CWT, raw (scored with tied E)", "cwt-ft": "CWT + head fine-tune"}
    lines = ["| model | steps | tokens | training FLOPs | share of budget | wall-clock s | val CE | LAMBADA acc / ppl |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        lam = run["lambada"]
        lam = f"{100 * lam['acc']:.1f}% / {lam['ppl']:,.0f}" if "acc" in lam else "-"
        lines.append(f"| {labels[name]} | {result['iters'][name]} | {run['tokens']:,} | {run['flops']:.3e} | "
                     f"{run['flops'] / result['budget_flops']:.3f} | {run['seconds']:.0f} | {run['val_ce']:.4f} | {lam} |")
    notes = {run["lambada"].get("note") for run in result["runs"].values()} - {None}
    lines += [f"\nLAMBADA: {note}" for note in sorted(notes)]
    return "\n".join(lines)


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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    if argv[:1] == ["_mem"]:  # internal: one memory measurement in this fresh process
        print(json.dumps(step_memory(json.loads(argv[1]))))
        return
    if argv[:1] == ["compare"]:
        cfg = parse_flags(CompareConfig, argv[1:])
        if cfg.plot:
            import_pyplot()  # fail before training, not after
        result = run_compare(cfg)
        if cfg.json:
            write_json(result, cfg.json)
        if cfg.plot:
            plot_compare(result, cfg.plot)
        return
    cfg = parse_flags(BenchConfig, argv)
    if cfg.plot:
        import_pyplot()
    result = run_bench(cfg)
    print(markdown_table(result))
    if cfg.json:
        write_json(result, cfg.json)
    if cfg.plot:
        plot_bench(result, cfg.plot)


if __name__ == "__main__":
    run_main(main)

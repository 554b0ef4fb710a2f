"""Speed and memory: cross-entropy vs Contrastive Weight Tying, and the data pipeline's throughput.

    python bench.py                     # loss layer + full training step, V = 8k..256k, CE vs CWT variants
    python bench.py --quick             # a small grid, under a minute on CPU
    python bench.py --mode=step --preset=pythia-70m --vocab=50304 --step_tokens=512 --repeats=9
    python bench.py --json=results/bench.json --plot=results/bench.png
    python bench.py --mode=mlm          # masked-LM steps only (BERT masking, 15% of positions scored)
    python bench.py --mode=data         # tokenisation (1 and 2 processes) and batch throughput
    torchrun --standalone --nproc_per_node=8 bench.py --mode=ddp   # tokens/s per rank, scaling efficiency
    python bench.py --gpu_check         # a few minutes: everything CUDA-specific works, in one report
    python bench.py --gpu_check --check_presets=tiny   # without CUDA: a CPU dry run of the same checks
    python bench.py --vocab_sweep=8192,32768,65536,131072,262144 --json=sweep.json --plot=sweep.png
    python bench.py --vocab_sweep=8192,32768,65536,131072,262144 --quick   # tiny shape: minutes on a CPU
    python bench.py --negatives_sweep=64,256,unique,all --quick            # CWT's cost as its negatives grow
    python bench.py --mode=val --preset=pythia-70m --vocab=50304 --step_tokens=16384 --block_size=2048
    python bench.py --mode=checkpoint   # loading a pythia-70m checkpoint (weights + AdamW) vs plain torch.load
    python bench.py --mode=resume       # is a stopped and resumed run bit-exact, at 1 and 2 CPU threads?

Speed: every variant of one configuration shares the same inputs and is timed in turn (A B C A B C ...)
so machine noise hits all of them alike; time per step is the median after warm-up. `loss` rows time
the objective alone (forward + backward from fixed hidden states (N, d) and the embedding E (V, d));
`step` rows time a whole training step of the preset (hidden states, loss, backward, clipping, AdamW);
`mlm` rows the same step of the preset as a masked-LM encoder (bidirectional attention, BERT masking),
whose losses score the 15% masked positions only: CWT's candidates are then those positions alone.
Memory: the extra memory one step needs once warmed up (inputs, weights and optimizer state excluded).
On CUDA, the peak allocated minus what was allocated before the step. On CPU, each configuration runs in a
fresh subprocess that, for each variant, takes one warm-up step, resets its peak resident set (VmHWM, via
/proc/self/clear_refs) and reports the peak during one more step minus the resident set before it.

--vocab_sweep: the paper's vocabulary figure. CE and CWT (--step_variants) at each size V, with the same
model body, the same --step_tokens per step and the same dtype: loss-layer rows and full-step rows, each
time and memory also as a ratio to the smallest V. --json writes a list of rows (kind, loss, vocab_size,
tokens, step_ms, peak_mib, ...); --plot draws time and memory against V.
--negatives_sweep=K1,K2,...,unique,all: CWT with k sampled negatives, each distinct target once, or every
position (all), CE beside; loss and step rows at each --vocab and --step_tokens, ratios to all and to CE;
--json writes a list of rows, --plot time and memory per entry (docs/negatives.md).
--mode=val: the extra memory and time of one validation pass (train.evaluate) over --step_tokens tokens,
for each of --step_variants scored whole and in chunks of --val_chunk rows (as --loss_chunk_size runs do).
--mode=checkpoint: the time to load a checkpoint of --preset (50304 tokens) with its AdamW state, through its
door (checkpoint.load_checkpoint: safetensors, the checksum, every field) and with the resume check of its optimizer
state (checkpoint_format.resumable), beside plain torch.load of the same payload saved by torch.save (weights_only,
mmap: what the door of a torch.save checkpoint called after its checks), interleaved, --repeats times, page cached.
--mode=resume: a tiny run of 8 steps on the built-in data beside the same run stopped after 4 and resumed, at
1 and 2 CPU threads: the largest difference of the logged losses, the weights and the optimizer state.
--chunked_ref=PATH: loss rows also time each -chunkN variant with the chunked.py at PATH ('<variant>@ref'),
interleaved with this one's: side-by-side figures for a change to the memory-flat losses."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import checkpoint
import checkpoint_format
import data
import doors
import prepare
import sources
import tokenizer
import train
from cli import config_path, parse_flags, refuse_idle, within_ranges
from common import UserError, first_line, run_main
from ddp import all_reduce_sum, barrier, init_distributed, is_main_process, rank, world_size
from devices import DeviceName, DtypeName, autocast_context, peak_flops, pick_device, pick_dtype
from doors import MAXIMA
from io_checks import declare_io
from loss import LossConfig, scored_columns, training_loss
from masking import NOT_MASKED, MaskSpec, mask_tokens, masked_rows, scored_rows
from model import PRESETS, PresetName, adamw, build_model
from results import import_pyplot, save_figure, save_results
from train import Objective, TrainConfig, Validation, evaluate, objective_loss, optimizer_step

MEMORY_NOTE = {"cuda": "peak allocated during one step (after a warm-up step) minus the memory allocated "
                       "before it",
               "cpu": "in a fresh subprocess per configuration, after a warm-up step: peak RSS (VmHWM) "
                      "during one more step minus the RSS before it (inputs, weights and optimizer state "
                      "excluded)"}


MAX_TOKENS = 1 << 22  # tokens of a measured step (a real one: ~500k, the paper's 256 x 2048)


@dataclass
class BenchConfig:
    mode: Literal["both", "loss", "step", "mlm", "data", "ddp", "val", "checkpoint", "resume"] = field(
        default="both", metadata={"help": "what to measure (the docstring above); both: loss and step rows"})
    preset: PresetName = field(default="pythia-70m", metadata={"help": "the model's shape (d) for every row"})
    vocab: list[int] = field(default_factory=lambda: [8192, 32768, 50304, 100352, 256000], metadata={
        "range": (2, MAXIMA["vocab_size"]), "help": "vocabulary sizes V"})
    tokens: list[int] = field(default_factory=lambda: [256, 1024], metadata={
        "range": (1, MAX_TOKENS), "help": "tokens per micro-batch, loss rows"})
    variants: list[str] = field(default_factory=lambda: ["ce", "cwt", "cwt-unique", "cwt-k256"], metadata={
        "help": "loss rows: ce, cwt, cwt-unique, cwt-kN or cwt-unique-kN, each optionally with -chunkN"})
    step_tokens: list[int] = field(default_factory=lambda: [256], metadata={
        "range": (1, MAX_TOKENS), "help": "tokens per micro-batch, step rows"})
    step_variants: list[str] = field(default_factory=lambda: ["ce", "cwt"], metadata={
        "help": "step rows' variants, as --variants"})
    block_size: int = field(default=256, metadata={
        "range": (1, MAXIMA["block_size"]), "help": "step rows: the length of each sequence of a micro-batch"})
    max_logits: int = field(default=1 << 26, metadata={
        "range": (1, 2**62), "help": "skip configurations whose CE logits (scored tokens x V) exceed this"})
    warmup: int = field(default=1, metadata={"range": (0, 10**6), "help": "untimed steps of each variant first"})
    repeats: int = field(default=3, metadata={"range": (1, 10**6), "help": "timed steps of each variant"})
    memory: bool = field(default=True, metadata={"help": "also measure each step's extra memory"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "auto: bfloat16 on CUDA (float16 without it), float32 on the CPU"})
    seed: int = field(default=0, metadata={"range": (0, 2**32 - 1), "help": "the random inputs' seed"})
    json: str = field(default="", metadata={"help": "also write the rows to this file"})
    plot: str = field(default="", metadata={"help": "an image of the rows (matplotlib)"})
    quick: bool = field(default=False, metadata={"help": "a small grid: fills the settings not given"})
    gpu_check: bool = field(default=False, metadata={
        "help": "run the GPU check instead; without CUDA or with --device=cpu, its dry run"})
    check_backend: Literal["inductor", "aot_eager", "eager"] = field(default="inductor", metadata={
        "help": "--gpu_check's torch.compile backend"})
    check_presets: list[PresetName] = field(default_factory=list, metadata={
        "help": "--gpu_check's step rows; empty: CHECK_PRESETS"})
    vocab_sweep: list[int] = field(default_factory=list, metadata={
        "range": (2, MAXIMA["vocab_size"]), "help": "sizes V: CE vs CWT across vocabularies"})
    negatives_sweep: list[str] = field(default_factory=list, metadata={
        "help": "k, unique, all: CWT's cost as its negatives grow"})
    val_chunk: int = field(default=1024, metadata={
        "range": (1, MAX_TOKENS), "help": "--mode=val: rows scored at a time by the chunked validation pass"})
    chunked_ref: str = field(default="", metadata={
        "help": "loss rows: another chunked.py, timed beside this one as '<variant>@ref'"})


def check_config(cfg: BenchConfig) -> None:
    """Every shape and count within bounds (a model's maxima, MAX_TOKENS), every variant valid and given once."""
    within_ranges(cfg)
    for name in ("vocab", "tokens", "variants", "step_tokens", "step_variants", "vocab_sweep"):
        values = getattr(cfg, name)
        if not values and name != "vocab_sweep":
            raise UserError(f"--{name} needs at least one value")
        if repeated := sorted({str(v) for v in values if values.count(v) > 1}):
            raise UserError(f"--{name} lists {', '.join(repeated)} more than once; pass each value once")
    for v in cfg.variants + cfg.step_variants:
        parse_variant(v)
    if cfg.chunked_ref and not Path(cfg.chunked_ref).is_file():
        raise UserError(f"--chunked_ref={cfg.chunked_ref} is not a file; give the path of a chunked.py to compare "
                        "with, e.g. one written by `git show main:chunked.py > /tmp/ref/chunked.py`")


QUICK = dict(preset="tiny", vocab=[8192, 50304], tokens=[512],
             variants=["ce", "cwt", "cwt-unique", "cwt-k128"], step_tokens=[512], repeats=3)
QUICK_SWEEP = dict(preset="tiny", step_tokens=[256], repeats=3)  # 256 x 262144 CE logits: max_logits exactly


def parse_variant(name: str) -> dict:
    """'ce', 'cwt', 'cwt-unique', 'cwt-k256', 'cwt-unique-k256' -> objective_loss keyword arguments;
    a '-chunkN' suffix (ce-chunk256, cwt-chunk1024) computes the loss N rows at a time."""
    m = re.fullmatch(r"(ce|cwt)(-unique)?(?:-k([1-9]\d{0,11}))?(?:-chunk([1-9]\d{0,11}))?", name)
    if not m or (m.group(1) == "ce" and (m.group(2) or m.group(3))):
        raise UserError(f"unknown variant {name!r}; use ce, cwt, cwt-unique, cwt-kN or cwt-unique-kN (N from 1 "
                        "to 12 digits), each optionally followed by -chunkN")
    return dict(loss=m.group(1), negatives="unique" if m.group(2) else "all",
                num_negatives=int(m.group(3)) if m.group(3) else None,
                chunk_size=int(m.group(4)) if m.group(4) else None)


def loss_config(variant: str) -> LossConfig:
    """The objective's settings of a variant name (parse_variant)."""
    kw = parse_variant(variant)
    return LossConfig(loss=kw["loss"], negatives=kw["negatives"], num_negatives=kw["num_negatives"],
                      loss_chunk_size=kw["chunk_size"] or 0)


def columns(variant: str, vocab: int, targets: torch.Tensor) -> int:
    """Output vectors each position is scored against: V for CE, N (U distinct with -unique) for CWT,
    at most k + 1 with -kN. The head FLOPs of a step are 6 * tokens * d * columns."""
    v = parse_variant(variant)
    candidates = int(targets.unique().numel()) if v["negatives"] == "unique" else targets.numel()
    return scored_columns(v["loss"], vocab, candidates, v["num_negatives"])


def zipf_tokens(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids with Zipf(1) frequencies (id = frequency rank), so repeats in a batch look like text."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


# ------------------------------------------------------------------- One configuration: set-up, step function and FLOPs


def step_setup(preset: str, vocab: int, tokens: int, block_size: int, seed: int, gen: torch.Generator,
               device: torch.device, causal: bool = True):
    """A fresh model of the preset, its optimizer, and tokens / block sequences of block + 1 Zipf tokens."""
    block = min(block_size, tokens)
    if tokens % block:
        raise UserError(f"step tokens {tokens} must be a multiple of --block_size={block}")
    torch.manual_seed(seed)
    model = build_model(preset, vocab, block_size=block, causal=causal).to(device)
    optimizer = adamw(model, 1e-4, 0.1, (0.9, 0.95))
    seq = zipf_tokens(tokens // block * (block + 1), vocab, gen).view(-1, block + 1).to(device)
    return model, optimizer, seq


def make_case(spec: dict, device: torch.device, dtype: torch.dtype):
    """({variant: step_fn}, {variant: flops}, extra) of the configuration `spec` (kind, preset, vocab, tokens, ...)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    vocab, tokens, variants = spec["vocab"], spec["tokens"], spec["variants"]
    loss_rng = torch.Generator()
    if spec["kind"] == "val":
        return val_case(spec, device, dtype, gen)
    if spec["kind"] == "loss":
        d = PRESETS[spec["preset"]]["d_model"]
        h = (torch.randn(tokens, d, generator=gen)).to(device).requires_grad_()
        emb = (0.02 * torch.randn(vocab, d, generator=gen)).to(device).requires_grad_()
        targets = zipf_tokens(tokens, vocab, gen).to(device)

        def make(variant):
            config = loss_config(variant.removesuffix(REF))
            module = reference_chunked(spec["chunked_ref"]) if variant.endswith(REF) else None

            def step():
                with autocast_context(device, dtype), chunked_as(module):
                    loss = objective_loss(h, targets, emb, emb, config, loss_rng)
                loss.backward()
                h.grad = emb.grad = None
            return step
        flops = {v: 6 * tokens * d * columns(v.removesuffix(REF), vocab, targets) for v in variants}
        return {v: make(v) for v in variants}, flops, {"d_model": d}

    mlm = spec["kind"] == "mlm"
    model, optimizer, seq = step_setup(spec["preset"], vocab, tokens, spec["block_size"], spec["seed"], gen,
                                       device, causal=not mlm)
    block = seq.size(1) - 1
    x, y = seq[:, :-1], seq[:, 1:]
    if mlm:  # BERT masking as train.py does it; the last id stands in for [MASK]
        x, y = mask_tokens(x, spec["seed"], 0, MaskSpec(vocab - 1, vocab - 1, ()))

    def make(variant):
        config = loss_config(variant)

        def step():
            with autocast_context(device, dtype):
                h, targets = masked_rows(model.hidden(x), y) if mlm else (model.hidden(x), y)
                loss = objective_loss(h, targets, model.wte.weight, model.output_weight, config, loss_rng)
            loss.backward()
            optimizer_step(optimizer, model.parameters())
        return step
    scored = y[y != NOT_MASKED] if mlm else y.reshape(-1)  # the positions the loss scores
    flops = {v: tokens * model.flops_per_token(block, 0) + 6 * model.config.d_model * scored.numel()
             * columns(v, vocab, scored) for v in variants}
    return {v: make(v) for v in variants}, flops, {"d_model": model.config.d_model, "block_size": block,
                                                   "batch_size": tokens // block}


REF = "@ref"  # a loss variant timed with --chunked_ref's chunked.py


def with_reference_variants(variants: list[str], ref: str) -> list[str]:
    """--chunked_ref: each -chunkN variant, then the same one with the reference chunked.py."""
    return [x for v in variants for x in ([v, v + REF] if ref and parse_variant(v)["chunk_size"] else [v])]


@functools.cache
def reference_chunked(path: str):
    """The chunked.py at `path` as a module of its own (the one imported as `chunked` stays as it is)."""
    spec = importlib.util.spec_from_file_location("chunked_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def chunked_as(module):
    """Code run inside imports `chunked` as `module` (the losses import it when called); None: unchanged."""
    if module is None:
        yield
        return
    saved = sys.modules.get("chunked")
    sys.modules["chunked"] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["chunked"]
        else:
            sys.modules["chunked"] = saved


def val_case(spec: dict, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    """make_case for kind "val": a train.evaluate pass as a decoder's run makes it (cwt: also its loss and accuracy)
    over tokens // block sequences of a fresh model, in one batch; -chunkN: N rows at a time."""
    vocab, tokens = spec["vocab"], spec["tokens"]
    block = min(spec["block_size"], tokens)
    if tokens % block:
        raise UserError(f"val tokens {tokens} must be a multiple of --block_size={block}")
    torch.manual_seed(spec["seed"])
    model = build_model(spec["preset"], vocab, block_size=block).to(device).eval()
    val = zipf_tokens(tokens + 1, vocab, gen).numpy()  # sequential windows: exactly tokens // block of them
    byte_counts = np.ones(len(val), dtype=np.uint32)  # every token one byte: the bits-per-byte sums still run

    def make(variant):
        objective = Objective(model, loss_config(variant))

        def step():
            evaluate(objective, data.ValSplit(val, byte_counts, [vocab - 1]),
                     Validation(batch_size=tokens // block, block_size=block, device=device, dtype=dtype,
                                max_batches=1))
        return step
    # forward only (a third of a training step); cwt also scores the tokens against each other, twice
    flops = {v: tokens * model.flops_per_token(block, vocab + (2 * tokens if v.startswith("cwt") else 0)) // 3
             for v in spec["variants"]}
    return {v: make(v) for v in spec["variants"]}, flops, {"d_model": model.config.d_model, "block_size": block,
                                                           "batch_size": tokens // block}


def val_variants(variants: list[str], chunk: int) -> list[str]:
    """--mode=val: each variant whole and in chunks of `chunk` rows (one given with -chunkN stays as it is)."""
    out = []
    for v in variants:
        kw = parse_variant(v)
        if kw["negatives"] != "all" or kw["num_negatives"] is not None:
            raise UserError(f"--mode=val measures validation, which scores every in-batch candidate: use ce or cwt "
                            f"(optionally -chunkN), not {v}")
        out += [v] if kw["chunk_size"] else [v, f"{v}-chunk{chunk}"]
    return list(dict.fromkeys(out))


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
            return dict.fromkeys(steps)  # no honest way to isolate a step: no figure
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
        return dict.fromkeys(spec["variants"])
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- The data pipeline


def bench_data() -> str:
    """Tokenisation throughput (1 and 2 processes) and batch-serving throughput, side by side."""
    tokenizer.load_tokenizer("gpt2")  # built once, outside the timings
    # Each speech is one document: many small documents, like TinyStories or web text.
    plays = [sources.clean_play(p.read_text(encoding="utf-8")) for p in sources.play_files()]
    docs = [speech for play in plays for speech in play.split("\n\n")]
    rows = []
    for num_proc in (1, 2):
        start = time.perf_counter()
        items = (("train", doc, True) for doc in docs)
        if num_proc == 1:
            encoded = tokenizer.encode_batches(items, "gpt2")
        else:
            from corpora import encode_in_processes
            encoded = encode_in_processes(items, "gpt2", num_proc)
        n = sum(len(ids) for _, ids, _, _ in encoded)
        seconds = time.perf_counter() - start
        rows.append((f"tokenise, num_proc={num_proc}", f"{len(docs) / seconds:,.0f} docs/s", n / seconds))
    tokens = data.open_split(prepare.ensure_dataset("shakespeare"), "train")
    batch, block, steps = 8, 256, 500
    sampler = data.BatchSampler(tokens, batch, block, seed=0)
    for name, batches in (("random batches (BatchSampler)", (sampler.get(i) for i in range(steps))),
                          ("sequential batches",
                           data.sequential_batches(tokens, batch, block, max_batches=steps))):
        start = time.perf_counter()
        count = sum(1 for _ in batches)
        seconds = time.perf_counter() - start
        rows.append((f"{name}, {batch}x{block} cpu", f"{count / seconds:,.0f} batches/s",
                     count * batch * block / seconds))
    lines = ["| benchmark | rate | tokens/s |", "|---|---|---|"]
    return "\n".join(lines + [f"| {name} | {rate} | {tokens_per_s:,.0f} |"
                              for name, rate, tokens_per_s in rows])


# ---------------------------------------------------------------------------------------------- Loading a checkpoint


def checkpoint_payload(preset: str, vocab: int = 50304) -> dict:
    """What train.py saves of a run of the preset after one AdamW step: weights, optimizer state, settings, counts."""
    torch.manual_seed(0)
    model = build_model(preset, vocab, block_size=64)
    optimizer = adamw(model, 1e-4, 0.1, (0.9, 0.95))
    x = torch.randint(0, vocab, (1, 17))
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer_step(optimizer, model.parameters())
    return checkpoint.Checkpoint(model=model.state_dict(), model_config=model.config, optimizer=optimizer.state_dict(),
                      train_config=dataclasses.asdict(TrainConfig(preset=preset, block_size=64, lr=1e-4)),
                      state=checkpoint.State(step=1, micro_batches=1, tokens=16, flops=1.0, loss=10.0),
                      rng=checkpoint.Rng(torch=torch.get_rng_state()))


def bench_checkpoint(cfg: BenchConfig) -> str:
    """Seconds to load one checkpoint of the preset, ours beside plain torch.load (--mode=checkpoint)."""
    payload = checkpoint_payload(cfg.preset)
    with tempfile.TemporaryDirectory() as tmp:
        ours, pt = Path(tmp) / "ckpt.safetensors", Path(tmp) / "ckpt.pt"
        checkpoint.save_checkpoint(ours, payload)
        torch.save(doors.plain(payload), pt)
        del payload

        def resume() -> None:
            checkpoint_format.resumable(ours, checkpoint.load_checkpoint(ours, TrainConfig))

        def checksum() -> None:
            with checkpoint_format.open_checkpoint(ours) as f:
                checkpoint_format.checksum(f.metadata()[doors.CHECKPOINT_KEY],
                                           {k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        steps = {"torch.load(weights_only, mmap) of ckpt.pt, no checks": lambda: torch.load(
                     pt, map_location="cpu", weights_only=True, mmap=True),
                 "torch.load(weights_only) of ckpt.pt, no checks": lambda: torch.load(
                     pt, map_location="cpu", weights_only=True),
                 "load_checkpoint(ckpt.safetensors): door, checksum, fields": lambda: checkpoint.load_checkpoint(
                     ours, TrainConfig),
                 "  the same + checkpoint_format.resumable (finite optimizer state)": resume,
                 "  of which the checksum (read + CRC-32 of every tensor)": checksum}
        times = time_interleaved(steps, cfg.warmup, cfg.repeats, torch.device("cpu"))
        sizes = (ours.stat().st_size, pt.stat().st_size)
    base = statistics.median(times[next(iter(times))])
    lines = [f"checkpoint of {cfg.preset} (50304 tokens) with its AdamW state: ckpt.safetensors "
             f"{sizes[0] / 1e6:,.0f} MB, ckpt.pt {sizes[1] / 1e6:,.0f} MB; median of {cfg.repeats}, interleaved, from "
             "the page cache", "", "| load | seconds | x torch.load(mmap) |", "|---|---|---|"]
    lines += [f"| {name} | {statistics.median(t):.3f} | {statistics.median(t) / base:.2f} |"
              for name, t in times.items()]
    return "\n".join(lines)


def bench_resume() -> str:
    """--mode=resume: how far a run stopped and resumed lies from the straight run, at 1 and 2 CPU threads."""
    lines = ["tiny preset, 8 steps (4, then --resume), seed 1337, constant lr, CPU, float32", "",
             "| threads | resumed vs straight: losses | weights | optimizer state | straight vs again: weights |",
             "|---|---|---|---|---|"]
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare.ensure_dataset("shakespeare", str(Path(tmp) / "data"))
        for n in (1, 2):
            torch.set_num_threads(n)
            runs = {}
            for name, stops in (("straight", (8,)), ("again", (8,)), ("resumed", (4, 8))):
                out = Path(tmp) / f"{name}{n}"
                for i, stop in enumerate(stops):
                    train.train(TrainConfig(dataset=str(folder), preset="tiny", block_size=64, batch_size=4,
                                                  max_iters=stop, eval_interval=4, eval_batches=2, log_interval=1,
                                                  lr_schedule="constant", device="cpu", dtype="float32",
                                                  compile=False, out_dir=str(out), resume=i > 0))
                runs[name] = (doors.run_log(out / "log.jsonl"),
                              checkpoint.load_checkpoint(out / "ckpt.safetensors", TrainConfig))
            (log_a, ckpt_a), (log_b, ckpt_b) = runs["straight"], runs["resumed"]
            losses = max(abs(a[k] - b[k]) for a, b in zip(log_a, log_b, strict=True) for k in a
                         if k in ("loss", "val_ce", "val_cwt"))
            weights = [max((ckpt_a.model[k] - other.model[k]).abs().max().item() for k in ckpt_a.model)
                       for other in (ckpt_b, runs["again"][1])]
            moments = max((a - ckpt_b.optimizer["state"][i][k]).abs().max().item()
                          for i, state in ckpt_a.optimizer["state"].items() for k, a in state.items()
                          if isinstance(a, torch.Tensor) and a.dim() > 0)
            lines.append(f"| {n} | {losses:.3g} | {weights[0]:.3g} | {moments:.3g} | {weights[1]:.3g} |")
    torch.set_num_threads(threads)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- The grid


def run_bench(cfg: BenchConfig) -> dict:
    """Measure every configuration of the grid; returns {"meta": ..., "rows": [...]}."""
    check_config(cfg)
    warn_if_every_negative(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    peak = peak_flops(device)
    grid = []
    if cfg.mode in ("both", "loss"):
        grid += [("loss", v, n, with_reference_variants(cfg.variants, cfg.chunked_ref)) for v in cfg.vocab
                 for n in cfg.tokens]
    if cfg.mode in ("both", "step"):
        grid += [("step", v, n, cfg.step_variants) for v in cfg.vocab for n in cfg.step_tokens]
    if cfg.mode in ("both", "mlm"):
        grid += [("mlm", v, n, cfg.step_variants) for v in cfg.vocab for n in cfg.step_tokens]
    if cfg.mode == "val":  # not skipped above max_logits: the whole logits of a pass are what is measured
        grid += [("val", v, n, val_variants(cfg.step_variants, cfg.val_chunk)) for v in cfg.vocab
                 for n in cfg.step_tokens]
    rows, skipped = [], []
    for kind, vocab, tokens, variants in grid:
        block = min(cfg.block_size, tokens)  # an encoder's CE scores its masked rows only, as masking counts them
        scored = scored_rows(max(1, tokens // block), block) if kind == "mlm" else tokens
        if scored * vocab > cfg.max_logits and kind != "val":
            skipped.append(f"{kind} V={vocab} N={tokens}")
            continue
        spec = dict(kind=kind, preset=cfg.preset, vocab=vocab, tokens=tokens, block_size=cfg.block_size,
                    variants=variants, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype, chunked_ref=cfg.chunked_ref)
        steps, flops, extra = make_case(spec, device, dtype)
        times = time_interleaved(steps, cfg.warmup, cfg.repeats, device)
        del steps
        memory = measure_memory(spec, device) if cfg.memory else dict.fromkeys(variants)
        for v in variants:
            rows.append(summarize(dict(kind=kind, variant=v, preset=cfg.preset, vocab=vocab, tokens=tokens,
                                       **extra, times_s=times[v], flops=flops[v], memory_bytes=memory[v]),
                                  times[variants[0]], memory[variants[0]], peak))
        if kind == "val":
            add_unchunked_ratios(rows[-len(variants):])
        print(f"measured {kind} V={vocab} N={tokens}: " + ", ".join(
            f"{r['variant']} {1e3 * r['time_s']:.1f} ms" for r in rows[-len(variants):]), file=sys.stderr)
    bases = ", ".join(f"{kind}: {variants[0]}" for kind, variants in {k: vs for k, _, _, vs in grid}.items())
    meta = dict(device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"CPU, {torch.get_num_threads()} threads", dtype=str(dtype).removeprefix("torch."),
                torch=torch.__version__, repeats=cfg.repeats, warmup=cfg.warmup,
                memory=MEMORY_NOTE[device.type],
                ratios=f"relative to the first variant of the same kind of row ({bases})",
                skipped=skipped, config=dataclasses.asdict(cfg))
    return {"meta": meta, "rows": rows}


def add_unchunked_ratios(rows: list[dict]) -> None:
    """Validation rows: the chunk size, and time and memory relative to the same loss scored whole."""
    for r in rows:
        kw = parse_variant(r["variant"])
        whole = next((b for b in rows if b["variant"] == kw["loss"]), None)
        mem, base = r["memory_bytes"], whole and whole["memory_bytes"]
        r.update(chunk_size=kw["chunk_size"], time_vs_unchunked=whole and r["time_s"] / whole["time_s"],
                 memory_vs_unchunked=mem / base if mem is not None and base else None)


def val_summary(result: dict) -> str:
    """--mode=val: one line per chunked variant: peak extra memory whole vs in chunks."""
    lines = []
    for r in result["rows"]:
        whole = next((b for b in result["rows"] if b["variant"] == parse_variant(r["variant"])["loss"]
                      and (b["vocab"], b["tokens"]) == (r["vocab"], r["tokens"])), None)
        if r.get("chunk_size") and whole and None not in (r["memory_bytes"], whole["memory_bytes"]):
            lines.append(f"validation, {whole['variant']}, V={r['vocab']:,}, {r['tokens']:,} tokens "
                         f"({r['batch_size']} x {r['block_size']}): {whole['memory_bytes'] / 2**20:,.0f} MiB whole vs "
                         f"{r['memory_bytes'] / 2**20:,.0f} MiB in chunks of {r['chunk_size']} rows "
                         f"(x{r['memory_vs_unchunked']:.3f}); {1e3 * whole['time_s']:,.0f} vs "
                         f"{1e3 * r['time_s']:,.0f} ms")
    return "\n".join(lines)


def warn_if_every_negative(cfg: BenchConfig) -> None:
    """Once per run: a -kN variant whose N tokens are no more than k scores every candidate (no sampling)."""
    ks = [(v, parse_variant(v)["num_negatives"]) for v in cfg.variants]
    full = sorted({f"{v} at {n} tokens" for v, k in ks for n in cfg.tokens if k is not None and k >= n})
    if full and cfg.mode in ("both", "loss"):
        print(f"warning: k is not below the candidates (tokens) for {', '.join(full)}: every candidate is "
              "scored, as without -kN", file=sys.stderr)


def summarize(row: dict, base_times: list[float], base_memory: int | None, peak: float | None) -> dict:
    """Add the derived figures: median and best (minimum) time, throughput, and ratios to the base variant.
    The best time is the least disturbed by other work on a shared machine."""
    t, best = statistics.median(row["times_s"]), min(row["times_s"])
    mem = row["memory_bytes"]
    return {**row, "time_s": t, "best_s": best, "tokens_per_s": row["tokens"] / t,
            "flops_per_s": row["flops"] / t, "mfu": row["flops"] / t / peak if peak else None,
            "time_ratio": t / statistics.median(base_times), "best_ratio": best / min(base_times),
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
        lines.append(f"| {r['kind']} | {r['vocab']:,} | {r['tokens']:,} | {r['variant']} | "
                     f"{1e3 * r['time_s']:,.1f} | {r['tokens_per_s']:,.0f} | {r['time_ratio']:.3f} | "
                     f"{1e3 * r['best_s']:,.1f} | {r['best_ratio']:.3f} | {mem} | {mratio} | "
                     f"{r['flops'] / 1e9:,.2f} | {last} |")
    notes = [f"{meta['device_name']}, {meta['dtype']}, torch {meta['torch']}; median (and best) of "
             f"{meta['repeats']} interleaved steps after {meta['warmup']} warm-up; shape "
             f"{rows[0]['preset'] if rows else '-'}.",
             f"memory: {meta['memory']}.", f"ratios: {meta['ratios']}."]
    if meta["skipped"]:
        notes.append("skipped (tokens x V above --max_logits): " + ", ".join(meta["skipped"]))
    return "\n".join(lines + [""] + notes)


TITLES = {"loss": "loss layer (fwd+bwd)", "step": "full training step", "mlm": "masked-LM training step",
          "val": "one validation pass"}


def plot_bench(result: dict, path: str) -> None:
    plt = import_pyplot()
    kinds = [k for k in ("loss", "step", "mlm", "val") if any(r["kind"] == k for r in result["rows"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        for key in sorted({(r["variant"], r["tokens"]) for r in rows}, key=lambda k: (k[1], k[0])):
            pts = sorted((r["vocab"], 1e3 * r["time_s"]) for r in rows if (r["variant"], r["tokens"]) == key)
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]}, {key[1]} tokens")
        ax.set(xscale="log", yscale="log", xlabel="vocabulary size V", ylabel="ms per step",
               title=f"{TITLES[kind]}, {rows[0]['preset']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(result["meta"]["device_name"], fontsize=9)
    save_figure(fig, path)


# ------------------------------ Vocabulary sweep: CE's cost grows with V, CWT's does not (the paper's figure, 20k-200k)


def run_vocab_sweep(cfg: BenchConfig) -> list[dict]:
    """run_bench's rows of cfg.step_variants at each V of cfg.vocab_sweep, one flat row per (kind, loss, V, tokens),
    with ratios to the same row at the smallest V and to CE at the same V."""
    if cfg.mode not in ("both", "loss", "step"):
        raise UserError(f"--vocab_sweep measures loss and step rows; drop --mode={cfg.mode} (or use loss or step)")
    sizes, rows = sorted(set(cfg.vocab_sweep)), []
    for kind in ("loss", "step") if cfg.mode == "both" else (cfg.mode,):
        result = run_bench(dataclasses.replace(cfg, mode=kind, vocab=sizes, tokens=cfg.step_tokens,
                                               variants=cfg.step_variants))
        meta = result["meta"]
        if meta["skipped"]:
            print(f"skipped (tokens x V above --max_logits={cfg.max_logits}; raise it to measure them): "
                  + ", ".join(meta["skipped"]), file=sys.stderr)
        rows += [sweep_row(r, meta, loss=r["variant"]) for r in result["rows"]]
    for r in rows:
        same = [b for b in rows if (b["kind"], b["loss"], b["tokens"]) == (r["kind"], r["loss"], r["tokens"])]
        smallest = min(same, key=lambda b: b["vocab_size"])
        ce = next((b for b in rows if (b["kind"], b["loss"], b["tokens"], b["vocab_size"])
                   == (r["kind"], "ce", r["tokens"], r["vocab_size"])), None)
        r.update(time_vs_smallest=r["step_ms"] / smallest["step_ms"],
                 memory_vs_smallest=_ratio(r["peak_mib"], smallest["peak_mib"]),
                 time_vs_ce=ce and r["step_ms"] / ce["step_ms"],
                 memory_vs_ce=ce and _ratio(r["peak_mib"], ce["peak_mib"]))
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def sweep_table(rows: list[dict]) -> str:
    lines = ["| kind | loss | V | tokens | ms/step | time ×smallest V | peak MiB | memory ×smallest V | time ×CE "
             "| memory ×CE |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['loss']} | {r['vocab_size']:,} | {r['tokens']:,} | {r['step_ms']:,.1f} | "
                     f"{r['time_vs_smallest']:.2f} | {optional(r['peak_mib'], ',.1f')} | "
                     f"{optional(r['memory_vs_smallest'], '.2f')} | {optional(r['time_vs_ce'], '.3f')} | "
                     f"{optional(r['memory_vs_ce'], '.3f')} |")
    if rows:
        r = rows[0]
        lines += ["", f"{r['device']}, {r['dtype']}, shape {r['preset']}; loss: the objective alone (fwd+bwd), step: "
                  "a whole training step; median of interleaved steps; peak MiB: the extra memory of one step "
                  "(see --help)."]
    return "\n".join(lines)


def plot_vocab_sweep(rows: list[dict], path: str) -> None:
    """Two panels, time and memory per step against V (log x), a line per (kind, loss)."""
    plt = import_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    losses = sorted({r["loss"] for r in rows})
    for (key, label), ax in zip((("step_ms", "ms per step"), ("peak_mib", "peak extra memory (MiB)")), axes):
        for kind, style in (("step", "-"), ("loss", "--")):
            for i, loss in enumerate(losses):
                pts = sorted((r["vocab_size"], r[key]) for r in rows
                             if (r["kind"], r["loss"]) == (kind, loss) and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                            label=f"{loss.upper()}, {TITLES[kind]}")
        ax.set(xscale="log", xlabel="vocabulary size V", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if rows:
        fig.suptitle(f"CE vs CWT across vocabulary sizes: {rows[0]['preset']}, {rows[0]['tokens']} tokens per step, "
                     f"{rows[0]['device']}, {rows[0]['dtype']}", fontsize=9)
    save_figure(fig, path)


# ------------------ Negatives sweep: CWT's cost as the candidates it scores grow (k sampled, unique, all), CE beside it

QUICK_NEGATIVES = dict(preset="tiny", vocab=[50304], step_tokens=[1024], block_size=128, repeats=3)


def negatives_variants(entries: list[str], candidates: int, flag: str = "--negatives_sweep") -> list[str]:
    """Sweep entries (k sampled negatives, unique, all) as variants (cwt-kN, cwt-unique, cwt) in that order, k
    ascending; a k not below the `candidates` of a micro-batch is refused: it would score them all, as `all`."""
    entries = [e.strip() for e in entries]
    if not entries or "" in entries:
        raise UserError(f"{flag} needs values: numbers k of sampled negatives, unique, all (e.g. {flag}=64,256,"
                        f"unique,all); got {','.join(entries)!r}")
    for e in entries:
        if e not in ("unique", "all") and not re.fullmatch(r"[0-9]+", e):
            raise UserError(f"{flag}: {e!r} is not a number of negatives k, unique or all")
    ks = [int(e) for e in entries if e not in ("unique", "all")]
    names = [f"k={k}" for k in ks] + [e for e in entries if e in ("unique", "all")]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"{flag} lists {', '.join(repeated)} more than once; pass each value once")
    if 0 in ks:
        raise UserError(f"{flag}: k=0 scores no negative at all; pass k >= 1")
    if too_many := [k for k in ks if k >= candidates]:
        raise UserError(f"{flag}: k={max(too_many)} is not below the {candidates} candidates of a micro-batch "
                        "(batch_size x block_size); it would score them all, as `all` does: pass a smaller k")
    return [f"cwt-k{k}" for k in sorted(ks)] + [v for e, v in (("unique", "cwt-unique"), ("all", "cwt"))
                                                if e in entries]


def negatives_label(variant: str) -> str:
    """How a sweep names a variant: CE, k=N, unique, all."""
    kw = parse_variant(variant)
    if kw["loss"] == "ce":
        return "CE"
    return f"k={kw['num_negatives']}" if kw["num_negatives"] else kw["negatives"]


def run_negatives_sweep(cfg: BenchConfig) -> list[dict]:
    """run_bench's rows of CWT with each entry of cfg.negatives_sweep and CE beside them (within --max_logits), one
    flat row each, with ratios to `all` (the paper's in-batch negatives) and to CE of the same kind, V and tokens."""
    if cfg.mode not in ("both", "loss", "step"):
        raise UserError(f"--negatives_sweep measures loss and step rows; drop --mode={cfg.mode} (or use loss or "
                        "step)")
    if cfg.vocab_sweep:
        raise UserError("--vocab_sweep and --negatives_sweep are two sweeps: pass one")
    variants = negatives_variants(cfg.negatives_sweep, min(cfg.step_tokens))
    rows, skipped = [], []
    for kind in ("loss", "step") if cfg.mode == "both" else (cfg.mode,):
        for vocab in cfg.vocab:
            for tokens in cfg.step_tokens:
                ce = ["ce"] if tokens * vocab <= cfg.max_logits else []
                skipped += [] if ce else [f"CE {kind} V={vocab} N={tokens}"]
                result = run_bench(dataclasses.replace(cfg, mode=kind, vocab=[vocab], tokens=[tokens],
                                                       step_tokens=[tokens], variants=ce + variants,
                                                       step_variants=ce + variants, max_logits=2**62))
                rows += [negatives_row(r, result["meta"]) for r in result["rows"]]
    if skipped:
        print(f"CE not measured (tokens x V above --max_logits={cfg.max_logits}; raise it to measure it): "
              + ", ".join(skipped), file=sys.stderr)
    for r in rows:
        key = (r["kind"], r["vocab_size"], r["tokens"])
        same = {b["variant"]: b for b in rows if (b["kind"], b["vocab_size"], b["tokens"]) == key}
        for name, base in (("all", same.get("cwt")), ("ce", same.get("ce"))):
            r[f"time_vs_{name}"] = base and r["step_ms"] / base["step_ms"]
            r[f"memory_vs_{name}"] = base and _ratio(r["peak_mib"], base["peak_mib"])
    return rows


def negatives_row(r: dict, meta: dict) -> dict:
    """A sweep_row named by label (CE, k=N, unique, all) and train.py's flags (negatives: none for CE)."""
    kw = parse_variant(r["variant"])
    return sweep_row(r, meta, label=negatives_label(r["variant"]), variant=r["variant"], loss=kw["loss"],
                     negatives=None if kw["loss"] == "ce" else kw["negatives"], num_negatives=kw["num_negatives"])


def sweep_row(r: dict, meta: dict, **names) -> dict:
    """A run_bench row as a sweep's flat row: kind, `names` (the variant's), vocab_size, tokens, step_ms, ..."""
    return dict(kind=r["kind"], **names, vocab_size=r["vocab"], tokens=r["tokens"], preset=r["preset"],
                step_ms=1e3 * r["time_s"], best_ms=1e3 * r["best_s"], tokens_per_s=r["tokens_per_s"],
                peak_mib=None if r["memory_bytes"] is None else r["memory_bytes"] / 2**20, flops=r["flops"],
                device=meta["device_name"], dtype=meta["dtype"])


def optional(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def negatives_table(rows: list[dict]) -> str:
    lines = ["| kind | V | tokens | negatives | ms/step | time ×all | peak MiB | memory ×all | time ×CE | memory ×CE |",
             "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['vocab_size']:,} | {r['tokens']:,} | {r['label']} | {r['step_ms']:,.1f} | "
                     f"{optional(r['time_vs_all'], '.3f')} | {optional(r['peak_mib'], ',.1f')} | "
                     f"{optional(r['memory_vs_all'], '.3f')} | {optional(r['time_vs_ce'], '.3f')} | "
                     f"{optional(r['memory_vs_ce'], '.3f')} |")
    if rows:
        r = rows[0]
        lines += ["", f"{r['device']}, {r['dtype']}, shape {r['preset']}; CWT with k sampled negatives, each distinct "
                  "target once (unique) or every position of the micro-batch (all, the paper's); loss: the objective "
                  "alone (fwd+bwd), step: a whole training step; median of interleaved steps; peak MiB: the extra "
                  "memory of one step (see --help)."]
    return "\n".join(lines)


def plot_negatives_sweep(rows: list[dict], path: str) -> None:
    """Time and memory per step against the negatives entry, a line per (kind, V, tokens); CE as a dashed level."""
    plt = import_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(dict.fromkeys(r["label"] for r in rows if r["loss"] == "cwt"))
    groups = list(dict.fromkeys((r["kind"], r["vocab_size"], r["tokens"]) for r in rows))
    for (key, ylabel), ax in zip((("step_ms", "ms per step"), ("peak_mib", "peak extra memory (MiB)")), axes):
        for i, group in enumerate(groups):
            mine = {r["label"]: r[key] for r in rows if (r["kind"], r["vocab_size"], r["tokens"]) == group}
            name = f"{TITLES[group[0]]}, V={group[1]:,}, {group[2]:,} tokens"
            pts = [(x, mine[label]) for x, label in enumerate(labels) if mine.get(label) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=f"CWT, {name}")
            if mine.get("CE") is not None:
                ax.axhline(mine["CE"], ls="--", lw=1, color=f"C{i}", label=f"CE, {name}")
        ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel="negatives scored per row (sampled k, unique targets, all)", ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if rows:
        fig.suptitle(f"CWT's cost as its negatives grow: {rows[0]['preset']}, {rows[0]['device']}, {rows[0]['dtype']}",
                     fontsize=9)
    save_figure(fig, path)


# --------------------------------------------------- Several ranks (torchrun): tokens/s per rank and scaling efficiency


def median_step_time(cfg: BenchConfig, variant: str, device: torch.device, dtype: torch.dtype,
                     parallel: bool) -> float:
    """Median seconds of a training step of the preset (step_tokens[0], vocab[0]); `parallel`: under DDP."""
    gen = torch.Generator().manual_seed(cfg.seed + rank())
    model, optimizer, seq = step_setup(cfg.preset, cfg.vocab[0], cfg.step_tokens[0], cfg.block_size, cfg.seed,
                                       gen, device)
    loss_rng = torch.Generator()
    objective = Objective(model, loss_config(variant))
    if parallel and torch.distributed.is_initialized():
        objective = torch.nn.parallel.DistributedDataParallel(objective)

    def step():
        with autocast_context(device, dtype):
            loss = objective(seq[:, :-1], seq[:, 1:], loss_rng)
        loss.backward()
        optimizer_step(optimizer, model.parameters())
    return statistics.median(time_interleaved({variant: step}, cfg.warmup, cfg.repeats, device)[variant])


def bench_ddp(cfg: BenchConfig) -> str:
    """Rank 0 times a training step alone (the others wait), then every rank under DDP; scaling efficiency: DDP
    tokens/s per rank / one rank's alone (1.0: linear). On CPU the ranks share the cores: it shows the path works."""
    device = init_distributed(pick_device(cfg.device))
    dtype = pick_dtype(cfg.dtype, device)
    tokens, n = cfg.step_tokens[0], world_size()
    lines = ["| variant | ranks | tokens/s one rank alone | tokens/s per rank, DDP | tokens/s, all ranks | "
             "scaling efficiency |", "|---|---|---|---|---|---|"]
    for variant in cfg.step_variants:
        alone = median_step_time(cfg, variant, device, dtype, parallel=False) if is_main_process() else 0.0
        barrier()
        together = torch.zeros(n, dtype=torch.float64, device=device)
        together[rank()] = median_step_time(cfg, variant, device, dtype, parallel=True)
        per_rank = tokens / all_reduce_sum(together).cpu()
        solo = tokens / alone if alone else float("nan")
        each = ", ".join(f"{t:,.0f}" for t in per_rank.tolist())
        lines.append(f"| {variant} | {n} | {solo:,.0f} | {each} | {per_rank.sum().item():,.0f} | "
                     f"{per_rank.mean().item() / solo:.3f} |")
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU, {torch.get_num_threads()} threads")
    note = (f"{name} per rank, {str(dtype).removeprefix('torch.')}, preset {cfg.preset}, V={cfg.vocab[0]}, "
            f"{tokens} tokens per rank per step; median of {cfg.repeats}.")
    return "\n".join(lines + ["", note])


# ---------- GPU check: `python bench.py --gpu_check` exercises every CUDA-only path in a few minutes; without CUDA
# (or with --device=cpu) the same checks run on a small shape as a CPU dry run, which skips what only a GPU has


@dataclass
class CheckShape:
    preset: str = "pythia-70m"
    vocab: int = 50304
    block: int = 512
    batch: int = 8
    steps: int = 12  # the training check: steps on one fixed batch
    repeats: int = 10  # the step rows: eager and compiled steps timed in turn, this many each
    train_iters: int = 30  # the train.py run


GPU_SHAPE = CheckShape()  # on a GPU, the checks and the step rows: the pythia-70m shape, 8 x 512 tokens
DRY_RUN_SHAPE = CheckShape(preset="tiny", vocab=8192, block=128, batch=2, steps=8, train_iters=10)  # CPU: checks
DRY_RUN_STEP_SHAPE = CheckShape(block=256, batch=2, repeats=5)  # the CPU's step rows, one per preset: 2 x 256
CHECK_PRESETS = {"cuda": ["pythia-70m"], "cpu": ["tiny", "pythia-70m"]}  # --check_presets' defaults


class CheckSkipped(Exception):
    """A check that cannot run on this machine (CUDA only, several GPUs): reported as skipped, not failed."""


@dataclass
class StepRow:
    """A training step of one preset and loss, eager and compiled (seconds; MFU and peak_mib None where unknown)."""
    preset: str
    loss: str
    tokens: str
    eager_s: float
    compiled_s: float
    tok_s: float
    mfu: float | None
    peak_mib: float | None
    compile_s: float
    graph_breaks: int
    recompiles: int
    loss_eager: float
    loss_compiled: float


def require(condition: bool, failure: str) -> None:
    """A check's verdict (unlike assert, kept under python -O)."""
    if not condition:
        raise RuntimeError(failure)


def skip(reason: str) -> Callable[[], str]:
    """A check that reports itself skipped, for `reason`."""
    def skipped() -> str:
        raise CheckSkipped(reason)
    return skipped


def _check_model(shape: CheckShape, device: torch.device, **overrides):
    torch.manual_seed(0)
    model = build_model(shape.preset, shape.vocab, block_size=shape.block, **overrides).to(device)
    gen = torch.Generator().manual_seed(0)
    seq = zipf_tokens(shape.batch * (shape.block + 1), shape.vocab, gen).view(shape.batch, -1).to(device)
    return model, seq[:, :-1], seq[:, 1:]


def check_training(device: torch.device, shape: CheckShape, dtype: torch.dtype, loss: str = "cwt") -> str:
    """Train on one fixed batch under autocast (fp16: a GradScaler), fused AdamW: the loss must be finite and fall."""
    model, x, y = _check_model(shape, device)
    optimizer = adamw(model, 1e-3, 0.1, (0.9, 0.95))
    require(optimizer.defaults["fused"], "AdamW is not fused")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    losses, start = [], 0.0
    for step in range(shape.steps):
        if step == 2:  # after warm-up
            sync(device)
            start = time.perf_counter()
        with autocast_context(device, dtype):
            value = training_loss(model.hidden(x), y, model.wte.weight, model.output_weight, LossConfig(loss=loss))
        scaler.scale(value).backward()
        optimizer_step(optimizer, model.parameters(), 1.0, scaler)
        losses.append(value.item())
    seconds = (time.perf_counter() - start) / (shape.steps - 2)
    require(all(map(math.isfinite, losses)) and losses[-1] < losses[0], f"losses {losses}")
    tok_s = x.numel() / seconds
    columns = scored_columns(loss, shape.vocab, x.numel())
    peak = peak_flops(device)
    mfu = f"MFU {100 * tok_s * model.flops_per_token(shape.block, columns) / peak:.1f}%" if peak else "MFU n/a"
    scale = f", loss scale {scaler.get_scale():g}" if scaler.is_enabled() else ""
    return f"{loss} loss {losses[0]:.3f} -> {losses[-1]:.3f}, {tok_s:,.0f} tok/s, {mfu}{scale}"


def check_fused_adamw(device: torch.device, shape: CheckShape) -> str:
    """One fused AdamW step equals one for-each step on the same weights and gradients."""
    model, x, y = _check_model(shape, device)
    training_loss(model.hidden(x), y, model.wte.weight, model.output_weight, LossConfig(loss="ce")).backward()
    before = [p.detach().clone() for p in model.parameters()]
    after = {}
    for fused in (True, False):
        with torch.no_grad():
            for p, b in zip(model.parameters(), before):
                p.copy_(b)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
        optimizer.step()
        after[fused] = [p.detach().clone() for p in model.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(after[True], after[False]))
    require(diff < 1e-6, f"fused and for-each AdamW differ by {diff:.2e}")
    return f"fused = for-each step (max abs diff {diff:.1e})"


def check_flash_attention(device: torch.device, shape: CheckShape, dtype: torch.dtype) -> str:
    """The model's causal attention on the flash kernel alone (forward and backward) agrees with the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model, x, _ = _check_model(shape, device)
    outputs = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel([backend]), autocast_context(device, dtype):
            h = model.hidden(x)
            h.float().square().mean().backward()
        outputs[backend] = h.float()
    diff = (outputs[SDPBackend.FLASH_ATTENTION] - outputs[SDPBackend.MATH]).abs().max().item()
    require(diff < 0.1, f"flash and math attention differ by {diff}")
    return f"flash kernel, forward and backward; max abs(flash - math) {diff:.1e} in {dtype}"


def measure_step(device: torch.device, shape: CheckShape, dtype: torch.dtype, loss: str, backend: str) -> StepRow:
    """A training step as train.py takes it, eager and compiled, on one model: the eager loss and the first compiled
    step on the same weights (its wall time less a steady step's is the compile time, inductor's caches off: what a
    first run pays), then eager and compiled steps in turn (medians); dynamo's counts of breaks and recompiles."""
    from torch._dynamo.utils import counters
    model, x, y = _check_model(shape, device)
    optimizer = adamw(model, 1e-4, 0.1, (0.9, 0.95))
    objective = Objective(model, LossConfig(loss=loss))
    generator = torch.Generator()
    torch._dynamo.reset()  # each row compiles afresh
    counters.clear()
    compiled = torch.compile(objective, backend=backend)

    def step(fn: Callable) -> torch.Tensor:
        with autocast_context(device, dtype):
            value = fn(x, y, generator)
        value.backward()
        optimizer_step(optimizer, model.parameters())
        return value

    with autocast_context(device, dtype):
        loss_eager = objective(x, y, generator).item()
    start = time.perf_counter()
    with torch.compiler.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # which is the point
        loss_compiled = step(compiled).item()
    first_s = time.perf_counter() - start
    frames = counters["frames"]["total"]
    times = time_interleaved({"eager": lambda: step(objective), "compiled": lambda: step(compiled)}, 1,
                             shape.repeats, device)
    recompiles = counters["frames"]["total"] - frames
    peak_mib = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step(compiled)
        sync(device)
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    compiled_s = statistics.median(times["compiled"])
    tok_s = x.numel() / compiled_s
    peak = peak_flops(device)
    flops_per_token = model.flops_per_token(shape.block, scored_columns(loss, shape.vocab, x.numel()))
    return StepRow(preset=shape.preset, loss=loss, tokens=f"{shape.batch}x{shape.block}",
                   eager_s=statistics.median(times["eager"]), compiled_s=compiled_s, tok_s=tok_s,
                   mfu=tok_s * flops_per_token / peak if peak else None, peak_mib=peak_mib,
                   compile_s=first_s - compiled_s, graph_breaks=sum(counters["graph_break"].values()),
                   recompiles=recompiles, loss_eager=loss_eager, loss_compiled=loss_compiled)


def check_compile(device: torch.device, shapes: list[CheckShape], dtype: torch.dtype, backend: str,
                  rows: list[StepRow]) -> str:
    """torch.compile of the training objective, CE and CWT at each shape: the first compiled step's loss equals
    the eager one. The rows (appended to `rows` as they are measured) are the report's step table."""
    for shape in shapes:
        for loss in ("ce", "cwt"):
            rows.append(measure_step(device, shape, dtype, loss, backend))
    tolerance = 1e-3 if dtype == torch.float32 else 1e-2
    wrong = [f"{r.preset} {r.loss}: compiled loss {r.loss_compiled:.5f}, eager {r.loss_eager:.5f}" for r in rows
             if abs(r.loss_compiled - r.loss_eager) > tolerance * max(1.0, abs(r.loss_eager))]
    require(not wrong, "; ".join(wrong))
    breaks = sum(r.graph_breaks for r in rows)
    recompiles = sum(r.recompiles for r in rows)
    return (f"{len(rows)} steps below: compiled loss = eager (rel. {tolerance:g}); {breaks} graph breaks, "
            f"{recompiles} recompiles")


def check_kv_cache(device: torch.device, shape: CheckShape, new_tokens: int = 48) -> str:
    """Greedy generation with the KV cache gives the tokens that re-reading the whole prefix gives."""
    from generate import generate
    model, x, _ = _check_model(shape, device)
    model.eval()
    prompt = x[0, :16].tolist()
    outputs, seconds = {}, {}
    for use_cache in (True, False):
        sync(device)
        start = time.perf_counter()
        outputs[use_cache] = list(generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache))
        sync(device)
        seconds[use_cache] = time.perf_counter() - start
    require(outputs[True] == outputs[False], "cached and uncached greedy generation differ")
    return f"{new_tokens} greedy tokens identical; {new_tokens / seconds[True]:,.0f} tok/s with the cache, " \
           f"{new_tokens / seconds[False]:,.0f} without"


def check_script(args: list[str], expect: str, timeout: float = 240) -> str:
    """A command (train.py, torchrun) that must succeed and print `expect`; returns its last matching line."""
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parent)
    lines = (out.stdout + out.stderr).strip().splitlines()
    require(out.returncode == 0, f"exit {out.returncode}: {lines[-1] if lines else ''}")
    hits = [line for line in lines if expect in line]
    require(bool(hits), f"no {expect!r} in the output")
    return hits[-1].strip()


def python_with_backend(backend: str) -> list[str]:
    """The command that runs a script with torch.compile's backend `backend` (inductor: the plain interpreter)."""
    if backend == "inductor":
        return [sys.executable]
    setup = ["import functools", "import runpy", "import sys", "import torch",
             f"torch.compile = functools.partial(torch.compile, backend={backend!r})",
             "sys.argv.pop(0)", "runpy.run_path(sys.argv[0], run_name='__main__')"]
    return [sys.executable, "-c", "\n".join(setup)]


def gpu_checks(device: torch.device, shape: CheckShape, step_shapes: list[CheckShape], dtype: torch.dtype,
               backend: str, scratch: Path, rows: list[StepRow]) -> dict[str, Callable[[], str]]:
    """The checks by name; the compile check appends its step rows to `rows`."""
    here = Path(__file__).parent
    train_flags = [f"--out_dir={scratch / 'train'}", f"--data_root={scratch / 'data'}",
                   f"--max_iters={shape.train_iters}", f"--eval_interval={shape.train_iters}", "--eval_batches=2",
                   f"--log_interval={max(1, shape.train_iters // 3)}", f"--preset={shape.preset}",
                   f"--block_size={shape.block}", f"--batch_size={shape.batch}"]
    progress = "MFU" if peak_flops(device) else "tok/s"  # train.py's progress line
    checks = {
        "bf16 autocast + fused AdamW": lambda: check_training(device, shape, torch.bfloat16),
        "fp16 autocast + GradScaler": lambda: check_training(device, shape, torch.float16, "ce"),
        "fused AdamW = for-each": lambda: check_fused_adamw(device, shape),
        "flash attention (SDPA)": (lambda: check_flash_attention(device, shape, torch.bfloat16))
        if device.type == "cuda" else skip("CUDA only: the GPU's flash kernels (a CPU has its own)"),
        f"torch.compile ({backend}), CE and CWT": lambda: check_compile(device, step_shapes, dtype, backend, rows),
        "KV-cache generation": lambda: check_kv_cache(device, shape),
        f"train.py --compile ({backend})": lambda: check_script(
            [*python_with_backend(backend), str(here / "train.py"), "--compile", *train_flags], progress),
    }
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
        checks[f"DDP over NCCL, {gpus} GPUs, global negatives"] = lambda: check_script(
            [*torchrun, str(here / "train.py"), *train_flags, f"--out_dir={scratch / 'ddp'}",
             "--negatives_scope=global"], progress)
        checks[f"DDP scaling, {gpus} GPUs"] = lambda: check_script(
            [*torchrun, str(here / "bench.py"), "--mode=ddp", "--preset=pythia-70m", "--vocab=50304",
             "--step_tokens=4096", "--block_size=512", "--step_variants=cwt", "--repeats=5"], "| cwt |")
    elif device.type == "cuda":
        checks["DDP over NCCL"] = skip("needs 2 or more GPUs, 1 here")
    else:
        checks["DDP over NCCL"] = skip("CUDA only: NCCL between GPUs (DDP over gloo on CPU: tests/test_distributed.py)")
    return checks


def run_checks(checks: dict[str, Callable[[], str]]) -> list[tuple[str, str, str, float]]:
    """(name, "ok" | "FAILED" | "skipped", detail or the reason's first line, seconds) of each check, all run."""
    rows = []
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result, detail = "ok", check()
        except CheckSkipped as e:
            result, detail = "skipped", first_line(e)
        except Exception as e:  # a failed check is reported, and the others still run
            result, detail = "FAILED", f"{type(e).__name__}: {first_line(e)}"
        rows.append((name, result, detail, time.perf_counter() - start))
        print(f"{result:<7} {name} ({rows[-1][3]:.0f} s)", file=sys.stderr)
    return rows


def step_table(rows: list[StepRow], shape: CheckShape, device: torch.device, dtype: torch.dtype) -> str:
    """The compile check's steps, one line each, and what the columns mean."""
    if not rows:
        return "No step rows: the compile check failed before its first."
    lines = ["| preset | loss | tokens | eager ms | compiled ms | eager/compiled | tok/s compiled | MFU | peak MiB | "
             "compile s | graph breaks | recompiles |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        peak = f"{r.peak_mib:,.0f}" if r.peak_mib is not None else "n/a"
        lines.append(f"| {r.preset} | {r.loss} | {r.tokens} | {1e3 * r.eager_s:,.1f} | {1e3 * r.compiled_s:,.1f} | "
                     f"{r.eager_s / r.compiled_s:.2f} | {r.tok_s:,.0f} | {mfu} | {peak} | {r.compile_s:.1f} | "
                     f"{r.graph_breaks} | {r.recompiles} |")
    memory = ("MFU at the GPU's dense bf16 peak; peak MiB: torch.cuda.max_memory_allocated during one compiled "
              "step (weights, AdamW state, activations)" if device.type == "cuda" else
              "MFU and peak MiB n/a on CPU (no peak FLOP/s known; bench.py --mode=step measures a step's memory "
              "in a fresh process)")
    note = (f"A step: train.py's Objective, backward, clipping, fused AdamW; V={shape.vocab}, "
            f"{str(dtype).removeprefix('torch.')}; median of {shape.repeats}, eager and compiled in turn. "
            f"compile s: the first compiled step minus a steady one, inductor's caches off. {memory}.")
    return "\n".join(lines + ["", note])


def checks_report(rows: list[tuple[str, str, str, float]], title: str, steps: str = "") -> str:
    """The one-screen report: the title, the checks, the step table (if any), and the count passed."""
    lines = [title, "", "| check | result | detail | s |", "|---|---|---|---|"]
    for name, result, detail, seconds in rows:
        cell = detail.replace("|", "\\|")  # a bare | would end the markdown cell (train.py's line has some)
        lines.append(f"| {name} | {result} | {cell} | {seconds:.0f} |")
    failed = sum(result == "FAILED" for _, result, _, _ in rows)
    skipped = sum(result == "skipped" for _, result, _, _ in rows)
    ran = len(rows) - skipped
    lines += ["", steps] if steps else []
    return "\n".join(lines + ["", f"{ran - failed} of {ran} checks passed, {skipped} skipped"])


def gpu_check(cfg: BenchConfig) -> tuple[str, bool]:
    """Every check on the first GPU, else (no CUDA, --device=cpu) a CPU dry run; the report and whether none failed."""
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    presets = cfg.check_presets or CHECK_PRESETS["cuda" if device.type == "cuda" else "cpu"]
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        shape = step_shape = GPU_SHAPE
        title = (f"GPU check: {torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, torch "
                 f"{torch.__version__}, CUDA {torch.version.cuda}, torch.compile backend {cfg.check_backend}")
    else:
        shape, step_shape = DRY_RUN_SHAPE, DRY_RUN_STEP_SHAPE
        threads = torch.get_num_threads()
        title = (f"CPU dry run of the GPU check (not a GPU result): CPU, {threads} thread{'s' * (threads > 1)}, "
                 f"torch {torch.__version__}, torch.compile backend {cfg.check_backend}")
    step_shapes = [dataclasses.replace(step_shape, preset=p) for p in presets]
    steps: list[StepRow] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        rows = run_checks(gpu_checks(device, shape, step_shapes, dtype, cfg.check_backend, Path(scratch), steps))
    report = checks_report(rows, title, step_table(steps, step_shape, device, dtype))
    return report, all(result != "FAILED" for _, result, _, _ in rows)


# ----------------------------------------------------------------------------------------------


def idle_settings(cfg: BenchConfig) -> dict[str, str]:
    """The settings that would change nothing in this run (refused: cli.refuse_idle), by what it measures."""
    names = [f.name for f in dataclasses.fields(BenchConfig)]
    if cfg.gpu_check:
        used = ("gpu_check", "check_backend", "check_presets", "device", "dtype")
        return {n: "with --gpu_check (it runs its own checks on its own shapes and prints its report)"
                for n in ["quick", *names] if n not in used}
    idle = dict.fromkeys(("check_backend", "check_presets"), "without --gpu_check")
    own = {"data": ("it times the built-in tokeniser and batches", ()),
           "resume": ("it runs its own tiny runs on the CPU", ()),
           "checkpoint": ("it times loading one checkpoint of --preset on the CPU",
                          ("preset", "warmup", "repeats", "quick"))}
    if cfg.mode in own:
        what, used = own[cfg.mode]
        return {**idle, **{n: f"with --mode={cfg.mode} ({what})" for n in names
                           if n not in ("mode", "gpu_check", *used)}}
    loss_rows = cfg.mode in ("both", "loss") and not (cfg.vocab_sweep or cfg.negatives_sweep)
    without = {"val_chunk": cfg.mode != "val", "max_logits": cfg.mode in ("val", "ddp"),
               "tokens": not loss_rows, "variants": not loss_rows or cfg.negatives_sweep,
               "chunked_ref": not loss_rows, "step_variants": cfg.mode == "loss" and not cfg.vocab_sweep
               or bool(cfg.negatives_sweep), "step_tokens": cfg.mode == "loss" and not cfg.vocab_sweep
               and not cfg.negatives_sweep, "vocab": bool(cfg.vocab_sweep),
               "json": cfg.mode == "ddp", "plot": cfg.mode == "ddp", "memory": cfg.mode == "ddp"}
    idle.update({n: f"with --mode={cfg.mode}{' and a sweep' if cfg.vocab_sweep or cfg.negatives_sweep else ''} "
                 "(it measures no row that uses it)" for n, unused in without.items() if unused})
    return idle


def main(argv: list[str]) -> None:
    if argv[:1] == ["_mem"]:  # internal: one memory measurement in this fresh process
        print(json.dumps(step_memory(json.loads(argv[1]))))
        return
    sweep = any(a.startswith(("--vocab_sweep=", "--vocab-sweep=")) for a in argv)
    negatives = any(a.startswith(("--negatives_sweep=", "--negatives-sweep=")) for a in argv)
    quick = QUICK_NEGATIVES if negatives else QUICK_SWEEP if sweep else QUICK
    cfg = parse_flags(BenchConfig, argv, quick=quick)
    baseline = BenchConfig(**quick, quick=True) if cfg.quick and not cfg.gpu_check else BenchConfig()
    refuse_idle(cfg, idle_settings(cfg), baseline)
    declare_io(reads={"--chunked_ref": cfg.chunked_ref, "--config": config_path(argv),
                      "the built-in dataset": data.dataset_dir("shakespeare") if cfg.mode == "data" else None},
               writes={"--json": cfg.json, "--plot": cfg.plot})
    if cfg.gpu_check:
        report, ok = gpu_check(cfg)
        print(report)
        sys.exit(0 if ok else 1)
    check_config(cfg)
    reports = {"data": bench_data, "checkpoint": lambda: bench_checkpoint(cfg), "resume": bench_resume}
    if cfg.mode in reports:
        print(reports[cfg.mode]())
        return
    if cfg.mode == "ddp":
        table = bench_ddp(cfg)
        if is_main_process():
            print(table)
        return
    if cfg.plot:
        import_pyplot(cfg.plot)
    if cfg.negatives_sweep or cfg.vocab_sweep:
        run, table, plot = ((run_negatives_sweep, negatives_table, plot_negatives_sweep) if cfg.negatives_sweep
                            else (run_vocab_sweep, sweep_table, plot_vocab_sweep))
        rows = run(cfg)
        print(table(rows))
        save_results(rows, cfg.json, cfg.plot, plot)
        return
    result = run_bench(cfg)
    print(markdown_table(result))
    if cfg.mode == "val":
        print(val_summary(result))
    save_results(result, cfg.json, cfg.plot, plot_bench)


if __name__ == "__main__":
    run_main(main)

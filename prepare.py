"""Text -> tokens -> memory-mapped shards: a dataset prepared for train.py (data.py reads it).

    python prepare.py                                           # the built-in Shakespeare plays
    python prepare.py --dataset=roneneldan/TinyStories          # a Hugging Face dataset (corpora.py)
    python prepare.py --dataset=$HOME/corpus --text_field=body  # local .txt, .jsonl or .parquet files
    python prepare.py --tokenizer=bpe:8192                      # a BPE of 8192 tokens learned from it (bpe.py)

`python data.py ...` runs this command too. A prepared dataset is a folder of train.bin and val.bin (token ids),
val.bytes (the UTF-8 bytes each val token stands for) and meta.json, which vouches for them (read through
doors.dataset). Validation holds out whole documents, the source's own val split or those whose text hashes below
--val_fraction; end-of-text follows each. The source's text comes from sources.py, its tokenizer from tokenizer.py."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import cli
import ddp
import doors
import io_checks
import safe_files
from common import UserError
from data import dataset_dir, load_meta
from doors import DATA_FORMAT, Shard, shard_dtypes, token_dtype
from sources import PrepareConfig, documents, play_folder
from tokenizer import encode_batches, load_tokenizer

# Preparing: documents -> (split, text, ends a document) -> token shards, a dataset replaced whole or not at all


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenise cfg.dataset into dataset_dir(...), built beside it and renamed into place as a unit once meta.json
    vouches for the rest (safe_files.atomic_folder): an interruption leaves the earlier dataset whole, or nothing."""
    check_config(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    io_checks.declare_io(reads={"--dataset": play_folder() if cfg.dataset == "shakespeare" else
                             io_checks.local_source(cfg.dataset),
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
        safe_files.recover_folder(out)  # a prepare.py killed mid-swap: its earlier dataset back in place
        check_replaceable(out)
        return write_dataset(cfg, out, enc, source, items, total)


def hold_dataset(out: Path) -> contextlib.AbstractContextManager:
    """The dataset folder `out` for this command alone (safe_files.hold_lock): its lock file lies beside it, as the
    folder itself is replaced whole."""
    return safe_files.hold_lock(out.parent, "prepare.py preparing it", f".{out.name}.lock")


def write_dataset(cfg: PrepareConfig, out: Path, enc: Any, source: str, items: Iterable[tuple[str, str, bool]],
                  total: int | None) -> dict:
    """The dataset built beside `out` and swapped into its place (prepare, holding its lock)."""
    with safe_files.atomic_folder(out) as tmp:
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
    if why := cli.settings_problem(cfg):
        raise UserError(why)
    idle = {"tokenizer_docs": "without --tokenizer=bpe:N (only a BPE is learned from the source)"}
    if cfg.dataset == "shakespeare":
        idle.update(dict.fromkeys(("subset", "split", "val_split", "text_field"),
                                  "for the built-in shakespeare (its plays are split by hash)"))
    cli.refuse_idle(cfg, {k: v for k, v in idle.items() if k != "tokenizer_docs" or
                             not cfg.tokenizer.startswith("bpe:")})


# The folder names a dataset may hold: anything else in a folder is a user's, and the folder is never replaced
DATASET_FILES = {"meta.json", "tokenizer.json", *shard_dtypes(2).keys(), ".lock"}


def check_replaceable(out: Path) -> None:
    """Prepare into `out` only where nothing but a dataset is replaced: no folder yet, an empty one, or one holding
    a meta.json and nothing but a dataset's files (a damaged or older dataset is prepared again)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{out} is a link or a file, not a dataset folder; prepare.py replaces only a folder it "
                        "prepared: pass another --name or --data_root")
    if not out.exists():
        return
    names = sorted(p.name for p in out.iterdir() if safe_files.TEMP_MARK not in p.name and p.name != ".lock")
    others = [n for n in names if n not in DATASET_FILES]
    if others or (names and "meta.json" not in names):
        shown = ", ".join(map(doors.clip, others or names))[:200]
        raise UserError(f"{out} holds files that are not a dataset's ({shown}); prepare.py replaces only a folder it "
                        "prepared: pass another --name or --data_root, or move them away")


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


# A dataset a command reads: the built-in corpus prepared on first use


def ensure_dataset(dataset: str = "shakespeare", data_root: str = "data") -> Path:
    """The prepared folder of `dataset`. The built-in corpus (shakespeare, or shakespeare-bpeN: a BPE of N tokens) is
    prepared on first use, and again when its door refuses it: by rank 0 under torchrun, while the others wait."""
    out = dataset_dir(dataset, data_root)
    if ddp.is_main_process() and not os.path.lexists(out) and safe_files.set_aside(out):
        with hold_dataset(out):  # a prepare.py killed mid-swap: its earlier dataset back in place, before any read
            safe_files.recover_folder(out)
    builtin = re.fullmatch(r"shakespeare(-bpe(\d+))?", dataset)
    try:
        load_meta(out)
    except UserError:  # missing, damaged or of an older format: a built-in one is prepared (again)
        if builtin and ddp.is_main_process():
            print(f"preparing the built-in {dataset} dataset in {out} (a few seconds)", file=sys.stderr)
            prepare(PrepareConfig(data_root=data_root, tokenizer=f"bpe:{builtin[2]}" if builtin[2] else "gpt2"))
    ddp.barrier()
    if not (out / "meta.json").exists():  # there but refused: its door says why, at load_meta
        raise UserError(f"dataset {dataset!r} is not prepared ({out / 'meta.json'} missing); run: python prepare.py "
                        f"{shlex.join([f'--dataset={dataset}', f'--data_root={data_root}'])}")
    return out


def main(argv: list[str]) -> None:
    cfg = cli.parse_flags(PrepareConfig, argv)
    meta = prepare(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)
    print(f"{meta['source']}: {meta['documents']:,} documents -> {out} ({meta['tokenizer']}, {meta['dtype']})\n"
          f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens")


if __name__ == "__main__":
    common.run_main(main)

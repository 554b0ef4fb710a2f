"""corpora.py: local .txt/.jsonl/.parquet files and hub datasets through `datasets`, their own validation
splits, one-document sources, several tokenising processes, and every bad input."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data import DOCS, assert_one_line_error, expected_splits, prepare_files, run_data_py

import corpora  # noqa: F401  (the extra under test: data.py reaches it for any source but shakespeare)
import data
import prepare
import tokenizer
from common import UserError
from data import open_split


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_local_files_round_trip(tmp_path, fmt):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(DOCS):
        if fmt == "txt":
            (src / f"{i}.txt").write_text(text)
        elif fmt == "jsonl":
            (src / f"{i}.jsonl").write_text(json.dumps({"body": text}) + "\n"
                                            + json.dumps({"body": None}) + "\n")
        else:
            pq.write_table(pa.table({"body": [text], "n": [i]}), src / f"{i}.parquet")
    field = {} if fmt == "txt" else {"text_field": "body"}  # a .txt file has no field: refused there as idle
    out = prepare_files(tmp_path, dataset=str(src), val_fraction=0.5, **field)
    assert out == tmp_path / "out" / "corpus"
    train, val = expected_splits(DOCS, 0.5)  # the first document is held out, whole
    assert open_split(out, "train", 50257).tolist() == train and open_split(out, "val").tolist() == val
    meta = data.load_meta(out)
    assert meta["documents"] == 3 and meta["train_tokens"] == len(train) and str(src) in meta["source"]


def test_parallel_tokenisation_writes_identical_shards(tmp_path):
    texts = [f"Document {i}: " + "lorem ipsum " * (i % 17 + 1) for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    one = prepare_files(tmp_path / "a", dataset=str(tmp_path / "docs.jsonl"))
    two = prepare_files(tmp_path / "b", dataset=str(tmp_path / "docs.jsonl"), num_proc=2)
    assert data.load_meta(one)["checksums"] == data.load_meta(two)["checksums"]
    assert open_split(one, "train").tolist() == expected_splits(texts, 0.05)[0]


def test_max_docs_and_max_tokens(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": "word " * 100 + f" {i}"}) + "\n" for i in range(3, 53)))
    settings = dict(dataset=str(corpus), val_fraction=0.5)
    assert data.load_meta(prepare_files(tmp_path / "a", max_docs=3, **settings))["documents"] == 3
    meta = data.load_meta(prepare_files(tmp_path / "b", max_tokens=250, **settings))
    assert meta["documents"] == 3  # stops after the document that reaches 250 tokens


@pytest.mark.parametrize("dataset, words", [
    ("/nonexistent/corpus.txt", ["does not exist"]),
    ("", ["--dataset is empty"]),
    ("tinystories", ["unknown dataset", "roneneldan/TinyStories"]),
    ("no-such-org/no-such-dataset", ["could not load dataset", "no-such-org/no-such-dataset"]),
])
def test_bad_dataset_names(tmp_path, dataset, words):
    with pytest.raises(UserError) as e:
        prepare_files(tmp_path, dataset=dataset)
    assert_one_line_error(e, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files, settings, words", [
    ({}, {}, ["holds no .txt, .jsonl or .parquet files"]),  # an empty folder
    ({"a.txt": "", "b.txt": ""}, {}, ["0 tokens"]),  # an empty corpus
    ({"a.jsonl": '{"content": "hi"}\n'}, {}, ["no field 'text'", "content", "--text_field"]),
    ({"a.jsonl": '{"text": 3}\n'}, {}, ["int, not text"]),
    ({"a.jsonl": '{"text": "ok"}\n{"text": broken\n'}, {}, ["could not read", "JSON parse error"]),
    ({"a.txt": "x", "b.jsonl": "{}"}, {}, ["mixes file formats"]),
    ({"a.txt": "hi"}, {"val_fraction": 0.1}, ["val split is empty", "no line break"]),
    ({"a.jsonl": '{"text": "one"}\n{"text": "two"}\n'}, {"val_fraction": 0.01}, ["val split is empty"]),
    ({"a.txt": "hi"}, {"val_fraction": 1.5}, ["--val_fraction"]),
])
def test_bad_corpora(tmp_path, files, settings, words):
    (tmp_path / "src").mkdir()
    for name, text in files.items():
        (tmp_path / "src" / name).write_text(text)
    with pytest.raises(UserError) as e:
        prepare_files(tmp_path, dataset=str(tmp_path / "src"), **settings)
    assert_one_line_error(e, *words)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == sorted(files)  # inputs untouched


def test_cli_bad_path_exits_2_with_one_line(tmp_path):
    result = run_data_py("--dataset=/nonexistent", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: /nonexistent does not exist")
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_rows_without_text_are_counted_and_reported(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"text": f"{i} one two three " * 20} for i in range(8)] + [{"title": "no text"}, {"text": ""}]
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare.prepare(prepare.PrepareConfig(dataset=str(src), data_root=str(tmp_path / "d"), val_fraction=0.5))
    assert meta["documents"] == 8 and meta["skipped_rows"] == 2
    assert "skipped 2 rows of" in capsys.readouterr().err


def test_the_hint_for_an_unprepared_dataset_works_when_followed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some words to train on\n" * 40)
    root = str(tmp_path / "d")
    with pytest.raises(UserError) as e:
        prepare.ensure_dataset(str(corpus), root)
    command = re.search(r"run: python prepare.py (.*)$", str(e.value))[1]
    prepare.main(command.split(" "))  # exactly what the hint says
    assert data.load_meta(prepare.ensure_dataset(str(corpus), root))["documents"] == 1
    # A folder with shards but no meta.json (what an interrupted preparation left before datasets were built
    # beside their folder and renamed into place whole) holds nothing data.py can read.
    broken = tmp_path / "d" / "broken"
    broken.mkdir()
    (broken / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(UserError, match="is not prepared .* missing"):
        prepare.ensure_dataset(str(broken), root)
    with pytest.raises(UserError) as e:
        data.load_meta(broken)
    assert "..." not in str(e.value) and f"--data_root={tmp_path / 'd'}" in str(e.value)


@pytest.mark.parametrize("file, flags, words", [
    ("a.txt", {"text_field": "body"}, "--text_field=body changes nothing for .txt files"),
    ("a.txt", {"split": "test"}, "--split=test changes nothing for a local path"),
    ("a.jsonl", {"subset": "en"}, "--subset=en changes nothing for a local path"),
])
def test_a_flag_a_local_source_never_reads_is_refused(tmp_path, file, flags, words):
    """Issue 42, contract 10: no idle flag is accepted silently."""
    (tmp_path / file).write_text('{"text": "one two"}\n' if file.endswith(".jsonl") else "one two\nthree")
    with pytest.raises(UserError, match=words):
        prepare_files(tmp_path, dataset=str(tmp_path / file), **flags)
    left = sorted(p.name for p in (tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else []
    assert left == [], left


def test_a_folder_with_its_own_validation_files_uses_them(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    train_docs, val_docs = ["one\ntwo three " * 20, "four five\nsix " * 20], ["held out " * 30]
    (src / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in train_docs))
    (src / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in val_docs))
    with pytest.raises(UserError, match=r"--val_fraction=0.99 changes nothing with the source's own validation"):
        prepare_files(tmp_path / "idle", dataset=str(src), val_fraction=0.99)  # issue 42: an idle flag is refused
    out = prepare_files(tmp_path, dataset=str(src))
    enc = tokenizer.load_tokenizer()
    assert open_split(out, "val").tolist() == enc.encode_ordinary(val_docs[0]) + [50256]
    assert open_split(out, "train").tolist() == sum((enc.encode_ordinary(t) + [50256] for t in train_docs), [])
    assert "own validation files" in data.load_meta(out)["source"]
    again = prepare_files(tmp_path / "hash", dataset=str(src), val_split="hash", val_fraction=0.5)
    assert data.load_meta(again)["val_tokens"] != data.load_meta(out)["val_tokens"]  # told otherwise: by hash
    (src / "test.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="test.jsonl is named neither as train nor as validation data"):
        prepare_files(tmp_path / "stray", dataset=str(src))


def test_one_text_file_is_split_once_at_a_line_break_near_its_end(tmp_path):
    lines = [f"line {i} of the only document" for i in range(100)]
    (tmp_path / "book.txt").write_text("\n".join(lines) + "\n")
    out = prepare_files(tmp_path, dataset=str(tmp_path / "book.txt"), val_fraction=0.1)
    enc = tokenizer.load_tokenizer()
    train, val = open_split(out, "train").tolist(), open_split(out, "val").tolist()
    assert 50256 not in train and val.count(50256) == 1 and val[-1] == 50256  # end-of-text: the document's end
    assert enc.decode(train + val[:-1]) == "\n".join(lines) + "\n"
    assert enc.decode(val[:-1]).startswith("line 9") and enc.decode(val[:-1]).count("\n") == 10


def test_a_second_source_never_replaces_a_dataset_of_the_same_name(tmp_path):
    import dataclasses

    out = tmp_path / "data" / "books"
    # Two local folders both called `books` map to data/books: the second must not replace the first.
    for name in ("a", "b"):
        (tmp_path / name / "books").mkdir(parents=True)
        (tmp_path / name / "books" / "x.txt").write_text(f"{name} words\n" * 50)
    cfg = prepare.PrepareConfig(dataset=str(tmp_path / "a" / "books"), data_root=str(tmp_path / "data"))
    prepare.prepare(cfg)
    first = (out / "train.bin").read_bytes()
    with pytest.raises(UserError, match=f"already holds a dataset prepared from {tmp_path / 'a' / 'books'}"):
        prepare.prepare(dataclasses.replace(cfg, dataset=str(tmp_path / "b" / "books")))
    assert (out / "train.bin").read_bytes() == first
    prepare.prepare(dataclasses.replace(cfg, val_fraction=0.2))  # the same source again: replaced, as asked
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "val.bytes"]

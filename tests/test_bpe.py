"""bpe.py: byte-level BPE tokenizers of exactly N tokens, the same bytes in every process."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import save_ckpt

import bpe
import data
import prepare
import sources
import tokenizer
from common import UserError
from hf import HFTokenizer

REPO = Path(__file__).resolve().parents[1]
UNICODE = ["Café, naïve façade; Œuvre à Zürich — déjà vu.\n",
           "日本語のテキストと中文文本，한국어도。\n",
           "Emoji: 😀🎉👩‍👩‍👧 and 🇫🇷 flags.\r\n"]
ROUND_TRIPS = ["Hello, world!", "  leading and trailing spaces  ", "\n\nnew\nlines\n",
               "windows\r\nlines\r\n", "Café naïve déjà Œuvre", "日本語 中文 한국어",
               "😀🎉👩‍👩‍👧🇫🇷", "<|endoftext|>", "a<|endoftext|>b", "\t tabs \x00 nul \x7f",
               "ÿ" * 5 + "\u0100\ufeff", ""]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """Three plays (~400 kB) and some text beyond ASCII."""
    return [sources.clean_play(p.read_text(encoding="utf-8")) for p in sources.play_files()[:3]] + UNICODE


@pytest.fixture(scope="module")
def trained(corpus: list[str]) -> dict:
    return {n: bpe.train_bpe(corpus, n) for n in (300, 1000)}


@pytest.mark.parametrize("n", [300, 1000])
def test_exactly_n_tokens_with_eot_last(trained: dict, n: int) -> None:
    tok = trained[n]
    enc = HFTokenizer(f"bpe:{n}", tok)
    assert enc.n_vocab == tok.get_vocab_size(with_added_tokens=True) == n
    assert enc.eot_token == tok.token_to_id(bpe.EOT) == n - 1
    vocab = tok.get_vocab(with_added_tokens=True)
    assert sorted(vocab.values()) == list(range(n))
    from tokenizers import pre_tokenizers

    assert {vocab[c] for c in pre_tokenizers.ByteLevel.alphabet()} == set(range(256))  # every byte


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_round_trips_any_text(trained: dict, text: str) -> None:
    enc = HFTokenizer("bpe:1000", trained[1000])
    ids = enc.encode_ordinary(text)
    assert enc.eot_token not in ids  # "<|endoftext|>" written in a text is plain text here
    assert enc.decode(ids) == text
    assert enc.encode_ordinary_batch([text, text], num_threads=2) == [ids, ids]


def test_eot_special_only_through_encode(trained: dict) -> None:
    enc = HFTokenizer("bpe:1000", trained[1000])
    ids = enc.encode("to be<|endoftext|>or not")
    assert ids.count(enc.eot_token) == 1
    assert enc.decode(ids) == "to be<|endoftext|>or not"
    assert len(enc.encode_ordinary(" the king")) < len(b" the king")  # merges were learned


_TRAIN_SCRIPT = """
import json, sys
import bpe
texts = json.load(open(sys.argv[1], encoding="utf-8"))
print(bpe.save_tokenizer_json(bpe.train_bpe(texts, 1000), sys.argv[2]))
"""


def test_same_bytes_in_other_processes(corpus: list[str], trained: dict, tmp_path: Path) -> None:
    """Two fresh processes (other Python hash seeds, Rust hash seeds and thread counts) write the
    same tokenizer.json as this one."""
    (tmp_path / "corpus.json").write_text(json.dumps(corpus), encoding="utf-8")
    procs = []
    for seed, threads in (("1", "1"), ("2", "2")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "RAYON_NUM_THREADS": threads, "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-c", _TRAIN_SCRIPT, str(tmp_path / "corpus.json"),
                                       str(tmp_path / f"tok{seed}.json")], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    shas = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        shas.append(out.strip())
    here = bpe.save_tokenizer_json(trained[1000], tmp_path / "here.json")
    assert shas == [here, here]
    assert (tmp_path / "tok1.json").read_bytes() == (tmp_path / "tok2.json").read_bytes() == \
        (tmp_path / "here.json").read_bytes()


def test_save_is_atomic_and_loadable(trained: dict, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tokenizer.json"
    sha = bpe.save_tokenizer_json(trained[300], path)
    assert sha == bpe.sha256_of(path) and len(sha) == 64
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left behind
    trained[300].save(str(tmp_path / "saved.json"))  # the same bytes as tokenizers' own save
    assert bpe.sha256_of(tmp_path / "saved.json") == sha
    enc = tokenizer.load_tokenizer(str(path))  # the project's loader reads it back
    assert (enc.n_vocab, enc.eot_token) == (300, 299)
    with pytest.raises(UserError, match="cannot read"):
        bpe.sha256_of(tmp_path / "missing.json")


def test_too_few_pairs_names_the_reachable_size() -> None:
    texts = ["hello world", "hello there"]
    with pytest.raises(UserError) as e:
        bpe.train_bpe(texts, 5000)
    msg = str(e.value)
    assert "\n" not in msg and "--tokenizer=bpe:" in msg and "larger corpus" in msg
    reachable = int(msg.split("at most ")[1].split()[0])
    assert 257 < reachable < 5000
    assert bpe.train_bpe(texts, reachable).get_vocab_size() == reachable  # exactly what it said
    assert bpe.train_bpe([], 257).get_vocab_size() == 257  # bytes and EOT need no text
    with pytest.raises(UserError, match="at least 257"):
        bpe.train_bpe(texts, 256)


@pytest.mark.parametrize("name, n", [("bpe:2048", 2048), ("bpe:257", 257), ("gpt2", None),
                                     ("hf:EleutherAI/pythia-70m", None), ("my/tokenizer.json", None)])
def test_parse_bpe_name(name: str, n: int | None) -> None:
    assert bpe.parse_bpe_name(name) == n


@pytest.mark.parametrize("name", ["bpe:0", "bpe:abc", "bpe:-5", "bpe:", "bpe:256", "bpe:1e4", "bpe: 300"])
def test_parse_bpe_name_refuses(name: str) -> None:
    with pytest.raises(UserError) as e:
        bpe.parse_bpe_name(name)
    assert str(e.value) == (f"--tokenizer={name}: N must be a whole number of tokens from 257 to 4,194,304 (in "
                            "ASCII digits), e.g. bpe:8192")


def test_sample_documents_reads_only_what_it_keeps() -> None:
    endless = (f"document {i}" for i in itertools.count())
    assert bpe.sample_documents(endless, 3) == ["document 0", "document 1", "document 2"]
    assert next(endless) == "document 3"  # nothing read past the sample
    assert bpe.sample_documents(iter(["a", "b"]), 5, progress=True) == ["a", "b"]
    with pytest.raises(UserError, match="max_docs=0"):
        bpe.sample_documents(["a"], 0)


def test_progress_goes_to_stderr_only(capfd: pytest.CaptureFixture) -> None:
    assert bpe.train_bpe(["hello world"] * 3, 262, progress=True).get_vocab_size() == 262
    out, err = capfd.readouterr()
    assert out == "" and "documents" in err


def test_a_tokenizer_for_a_mix_takes_each_source_in_its_alpha_share(tmp_path):
    big = [f"big document {i} " * 50 for i in range(40)]  # 40 x ~800 bytes
    small = [f"tiny {i} " * 50 for i in range(10)]  # 10 x ~350 bytes
    size = lambda docs: sum(len(t.encode()) for t in docs)  # noqa: E731
    sizes = [size(big), size(small)]
    for alpha in (0.5, 0.3):
        mixed = bpe.mixed_documents([big, small], alpha)
        taken = [size([t for t in mixed if t in big]), size([t for t in mixed if t in small])]
        # the small source is limiting: taken whole; the big one's bytes in the ratio of (bytes)^alpha, to
        # within its last document
        assert taken[1] == sizes[1]
        assert 0 <= taken[0] - sizes[1] * (sizes[0] / sizes[1]) ** alpha < len(big[-1].encode())
    by_size = bpe.mixed_documents([big, small], alpha=1.0)  # alpha 1: by size, both whole
    assert by_size == big + small
    # documents of unequal lengths: the shares are of bytes, not of documents
    long, short = ["x" * 100] * 10, ["y" * 10] * 100
    assert bpe.mixed_documents([long, short], alpha=1.0) == long + short


def test_the_mix_command_writes_a_tokenizer_data_py_then_uses(tmp_path, monkeypatch):

    monkeypatch.chdir(tmp_path)
    bpe.main(["--sources=shakespeare", "--vocab_size=300", f"--out={tmp_path / 'mix' / 'tokenizer.json'}",
              "--docs_per_source=4"])
    meta = prepare.prepare(prepare.PrepareConfig(tokenizer=str(tmp_path / "mix" / "tokenizer.json"), max_docs=4,
                                           val_fraction=0.25, data_root=str(tmp_path / "data")))
    assert meta["vocab_size"] == 300 and (tmp_path / "data" / "shakespeare-mix" / "tokenizer.json").is_file()


def test_a_bpe_dataset_leaves_the_gpt2_dataset_of_its_source_untouched(tmp_path):
    settings = dict(dataset="shakespeare", max_docs=4, val_fraction=0.25, data_root=str(tmp_path))
    prepare.prepare(prepare.PrepareConfig(**settings))
    gpt2 = {p.name: p.read_bytes() for p in (tmp_path / "shakespeare").iterdir()}
    meta = prepare.prepare(prepare.PrepareConfig(**settings, tokenizer="bpe:300"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "shakespeare").iterdir()} == gpt2
    assert meta["tokenizer"] == "bpe:300" and data.load_meta(tmp_path / "shakespeare-bpe300")["vocab_size"] == 300
    assert (tmp_path / "shakespeare-bpe300" / "tokenizer.json").is_file()


def test_the_export_command_carries_a_trained_tokenizer(trained, tmp_path):
    """`python hf.py export` as users run it (hf.py is then __main__) on a checkpoint of a bpe:N dataset."""
    import dataclasses

    from model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, d_model=16))
    tokenizer = HFTokenizer("bpe:300", trained[300])
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "bpe:300", "tokenizer_sha256": tokenizer.sha256, "eot_token": 299},
                "tokenizer_json": tokenizer.json, "train_config": {"loss": "cwt"}}, tmp_path / "ckpt.safetensors")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(REPO / "hf.py"), "export", f"--ckpt={tmp_path / 'ckpt.safetensors'}",
                           f"--out={out}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    from tokenizers import Tokenizer

    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert exported.encode("Café 日本語").ids == trained[300].encode("Café 日本語").ids


def test_bpe_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): bpe.py's --out against a --sources folder."""
    from helpers import io_pairs

    io_pairs({"bpe --sources": (bpe.main, "corpus", ("same", "inside", "holds", "link", "link_parent"),
                                "tokenizer.json", lambda i, o: [f"--sources={i}", "--vocab_size=300", f"--out={o}"])})(
        tmp_path_factory, monkeypatch, capsys)

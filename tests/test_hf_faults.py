"""Fault injection for the Hugging Face bridge (hf.py) and glue.py: hostile or broken configs, weight files,
tokenizers, export targets and GLUE rows are each one line (a UserError naming the file or field), fast,
and never a large allocation. Errors the test user (root) cannot provoke through file modes (EROFS, EACCES,
ENOSPC) are injected by monkeypatching."""
import dataclasses
import errno
import importlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import DELETE, Worker, one_line_refusal, read_ckpt, save_ckpt, snapshot
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file
from test_hf import random_neox

import bpe
import glue
import hf
from common import UserError
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]


def one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    for word in words:
        assert word in message, (word, message)
    return message


@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory) -> Path:
    """A tiny untied GPT-NeoX folder as transformers saves it: 2 layers, hidden 64, 4 heads, MLP 96,
    vocabulary 96."""
    folder = tmp_path_factory.mktemp("neox") / "model"
    random_neox(folder)
    return folder


@pytest.fixture
def folder(valid_folder, tmp_path) -> Path:
    """A fresh copy of the valid folder, to corrupt."""
    return Path(shutil.copytree(valid_folder, tmp_path / "model"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is DELETE]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def load_fails(source: Path, *words: str, seconds: float = 1.0) -> str:
    start = time.perf_counter()
    with pytest.raises(UserError) as e:
        hf.load_hf(str(source))
    assert time.perf_counter() - start < seconds
    return one_line(e, *words)


# ----------------------------------------------------------------------------------------------
# config.json fields


def write(text: str | bytes):
    def apply(folder: Path) -> None:
        path = folder / "config.json"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return apply


def change(**changes):
    return lambda folder: edit_config(folder, **changes)


def rope(**changes):
    def apply(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(folder, rope_parameters={**config["rope_parameters"], **changes})
    return apply


def replace_by(kind: str):
    def apply(folder: Path) -> None:
        path = folder / "config.json"
        path.unlink()
        if kind == "folder":
            path.mkdir()
        elif kind == "dangling":
            path.symlink_to(folder / "nowhere.json")
        elif kind == "device":
            path.symlink_to("/dev/zero")
    return apply


CONFIG_FAULTS = {
    "a list": (write("[1, 2]"), ["config.json", "list", "not an object"]),
    "not JSON": (write("{\"model_type\": "), ["config.json", "not valid JSON"]),
    "binary": (write(os.urandom(64) + b"\xff"), ["config.json", "not UTF-8"]),
    "deeply nested": (write("[" * 100000), ["config.json", "nested too deeply"]),
    "a folder": (replace_by("folder"), ["config.json", "folder"]),
    "dangling link": (replace_by("dangling"), ["config.json", "dangling"]),
    "a device": (replace_by("device"), ["config.json", "not a regular file"]),
    "no hidden_size": (change(hidden_size=DELETE), ["hidden_size", "has no"]),
    "no vocab_size": (change(vocab_size=DELETE), ["vocab_size", "has no"]),
    "string size": (change(hidden_size="64"), ["hidden_size", "'64'", "positive whole number"]),
    "float size": (change(num_hidden_layers=2.0), ["num_hidden_layers", "2.0", "whole number"]),
    "zero heads": (change(num_attention_heads=0), ["num_attention_heads", "positive"]),
    "negative vocab": (change(vocab_size=-96), ["vocab_size", "-96"]),
    "bool layers": (change(num_hidden_layers=True), ["num_hidden_layers", "True"]),
    "string intermediate": (change(intermediate_size="96"), ["intermediate_size"]),
    "head_dim": (change(head_dim=7), ["head_dim 7"]),
    "rope_parameters list": (change(rope_parameters=[0.25]), ["rope_parameters", "not an object"]),
    "rotary factor 0": (rope(partial_rotary_factor=0), ["partial_rotary_factor", "(0, 1]"]),
    "rotary factor 1.5": (rope(partial_rotary_factor=1.5), ["partial_rotary_factor", "(0, 1]"]),
    "rotary odd channels": (rope(partial_rotary_factor=0.2), ["partial_rotary_factor", "even"]),
    "rotary_pct string": (change(rope_parameters=DELETE, rotary_pct="0.25"), ["rotary_pct", "(0, 1]"]),
    "rope_theta NaN": (rope(rope_theta=math.nan), ["rope_theta", "nan", "positive"]),
    "eps NaN": (change(layer_norm_eps=math.nan), ["layer_norm_eps", "nan"]),
    "eps 0": (change(layer_norm_eps=0), ["layer_norm_eps", "positive"]),
    "eps negative": (change(layer_norm_eps=-1e-5), ["layer_norm_eps", "positive"]),
    "huge context": (change(max_position_embeddings=(1 << 20) + 1), ["max_position_embeddings", "at most"]),
    "flag string": (change(tie_word_embeddings="false"), ["tie_word_embeddings", "true or false"]),
    "activation list": (change(hidden_act=["gelu"]), ["hidden_act"]),
    "rope scaling": (change(rope_scaling={"type": "linear", "factor": 2.0}), ["rope scaling"]),
    "4000-digit size": (change(hidden_size=10**4000), ["hidden_size", "at most"]),
    "4000-digit eps": (change(layer_norm_eps=10**4000), ["layer_norm_eps", "positive number"]),
    "5000-digit number": (write('{"hidden_size": ' + "1" * 5000 + "}"), ["config.json", "Exceeds the limit"]),
    "long value": (change(model_type="x" * 100000), ["model_type", "..."]),
}


@pytest.mark.parametrize("fault", CONFIG_FAULTS)
def test_config_faults_are_one_line(folder, fault):
    corrupt, words = CONFIG_FAULTS[fault]
    corrupt(folder)
    load_fails(folder, *words)


def resave(folder: Path, fn) -> None:
    """Rewrite model.safetensors with fn(state) (a valid file, but other tensors)."""
    state = load_file(folder / "model.safetensors")
    fn(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def misshape(state):
    state["gpt_neox.layers.1.attention.dense.weight"] = torch.zeros(64, 32)


# Small wrong sizes only: the hostile ones (a million layers...) run in a memory-bounded subprocess below,
# so that a regression fails there instead of allocating gigabytes in the test process.
SHAPE_FAULTS = {
    "more layers": (change(num_hidden_layers=3), ["num_hidden_layers is 3", "hold 2 layers"]),
    "fewer layers": (change(num_hidden_layers=1), ["num_hidden_layers is 1", "hold 2 layers"]),
    "vocab": (change(vocab_size=97), ["vocab_size 97", "gpt_neox.embed_in.weight", "[96, 64]"]),
    "hidden": (change(hidden_size=128), ["hidden_size 128", "embed_in", "[96, 64]"]),
    "intermediate": (change(intermediate_size=128), ["intermediate_size 128", "dense_h_to_4h", "[96, 64]"]),
    "misshaped tensor": (lambda f: resave(f, misshape),
                         ["gpt_neox.layers.1.attention.dense.weight", "[64, 32]", "[64, 64]"]),
    "missing layer tensor": (lambda f: resave(f, lambda s: s.pop("gpt_neox.layers.1.mlp.dense_4h_to_h.bias")),
                             ["gpt_neox.layers.1.mlp.dense_4h_to_h.bias missing from the weights"]),
    "untied without embed_out": (lambda f: resave(f, lambda s: s.pop("embed_out.weight")),
                                 ["embed_out.weight", "missing from the weights"]),
    "gap in layers": (lambda f: resave(f, lambda s: s.update({"gpt_neox.layers.7.attention.dense.bias":
                                                               torch.zeros(64)})), ["hold 8 layers"]),
}


@pytest.mark.parametrize("fault", SHAPE_FAULTS)
def test_config_is_checked_against_the_weight_shapes_before_building(folder, fault):
    corrupt, words = SHAPE_FAULTS[fault]
    corrupt(folder)
    load_fails(folder, *words)


def to_bin(folder: Path) -> None:
    """The same weights as a pytorch_model.bin (a pickled state dict) instead of model.safetensors."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


def test_a_pytorch_model_bin_is_refused_naming_the_conversion_that_works(folder):
    """A pickle is never read (issue 40): a folder of pytorch_model.bin alone is one line naming the command that
    converts it (transformers' own loader); run, it gives the same weights, which load and are checked as ever."""
    expected = load_file(folder / "model.safetensors")
    to_bin(folder)
    message = load_fails(folder, "pytorch_model.bin", "never read", CONVERT)
    command = message.split("convert it once with ", 1)[1]  # quoted for the shell, to paste from any folder
    subprocess.run(["bash", "-c", command], cwd=folder.parent, check=True, capture_output=True, timeout=120)
    assert {"pytorch_model.bin", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    converted = load_file(folder / "model.safetensors")
    assert all(torch.equal(converted.get(k, converted.get(k.replace("embed_out.", "lm_head."))), v)
               for k, v in expected.items())
    model, _ = hf.load_hf(str(folder))  # the converted folder loads, and its shapes are checked against config.json
    assert model.config.n_layer == 2
    edit_config(folder, num_hidden_layers=3)
    load_fails(folder, "num_hidden_layers is 3", "2 layers")


# ----------------------------------------------------------------------------------------------
# Weight files


def header_bytes(header) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw


def edit_header(folder: Path, fn) -> None:
    """Rewrite model.safetensors's header with fn(header), keeping the tensor bytes."""
    data = (folder / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    fn(header)
    (folder / "model.safetensors").write_bytes(header_bytes(header) + data[8 + length:])


def weights(content=None, kind: str = "file", name: str = "model.safetensors"):
    def apply(folder: Path) -> None:
        data = content(folder) if callable(content) else content
        (folder / "model.safetensors").unlink()
        path = folder / name
        if kind == "file":
            path.write_bytes(data)
        elif kind == "folder":
            path.mkdir()
        elif kind == "dangling":
            path.symlink_to(folder / "gone.safetensors")
        elif kind == "device":
            path.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(path)
    return apply


def truncated(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()[:-1000]


def entry(name: str, **changes):
    return lambda folder: edit_header(folder, lambda h: h[name].update(changes))


class NotAllowed:  # a pickled object torch.load(weights_only=True) refuses
    pass


def pickled(obj):
    def content(folder: Path) -> bytes:
        torch.save(obj, folder / "obj.pt")
        return (folder / "obj.pt").read_bytes()
    return content


EMBED = "gpt_neox.embed_in.weight"
LAYER0_BIAS, LAYER1_BIAS = (f"gpt_neox.layers.{i}.attention.dense.bias" for i in (0, 1))
CONVERT = ".save_pretrained("  # the command a refused pytorch_model.bin names
BROKEN = "not a valid safetensors file"  # the safetensors library's own checks of the header, named in one line
WEIGHT_FAULTS = {
    "garbage": (weights(b"\x93NUMPY garbage " * 100), ["not a safetensors file", "claim a header of"]),
    "empty": (weights(b""), ["model.safetensors", "0 bytes, too few"]),
    "short": (weights(b"\x01\x02\x03"), ["3 bytes, too few"]),
    "truncated": (weights(truncated), [BROKEN, "cut short"]),
    "huge header": (weights(struct.pack("<Q", 1 << 60) + b"{}" * 10), ["more than a header can be (16,777,216)"]),
    "header past the end": (weights(struct.pack("<Q", 100) + b"{}"),
                            ["header of 100 bytes", "more than the file holds"]),
    "header not JSON": (weights(header_bytes(b"{nope")), [BROKEN, "invalid JSON"]),
    "header nested": (weights(header_bytes(b"[" * 100000)), [BROKEN, "invalid"]),
    "header a list": (weights(header_bytes([1, 2])), [BROKEN, "invalid type: sequence"]),
    "entry not a dict": (lambda f: edit_header(f, lambda h: h.update({EMBED: [1]})), [BROKEN, "invalid type"]),
    "offsets past the end": (entry(EMBED, data_offsets=[0, 10**12]), [BROKEN, EMBED]),
    "offsets reversed": (entry(EMBED, data_offsets=[8, 4]), [BROKEN, EMBED]),
    "offsets negative": (entry(EMBED, data_offsets=[-4, 8]), [BROKEN, "-4"]),
    "dtype x shape": (entry(EMBED, dtype="F16"), [BROKEN, "invalid shape, data type, or offset"]),
    "unknown dtype": (entry(EMBED, dtype="Q7"), [BROKEN, "Q7"]),
    "bad shape": (entry(EMBED, shape=[96, "64"]), [BROKEN, '"64"']),
    "huge shape": (entry(EMBED, shape=[10**4000, 64]), [BROKEN, "out of range"]),
    "many huge dims": (entry(EMBED, shape=[(1 << 64) - 1] * 64), [BROKEN, "overflow"]),
    "holes": (weights(lambda f: (f / "model.safetensors").read_bytes() + b"x" * 8),  # bytes no tensor covers
              ["model.safetensors", BROKEN, "not fully covered"]),
    "a folder": (weights(kind="folder"), ["model.safetensors", "is a folder"]),
    "a device": (weights(kind="device"), ["model.safetensors", "not a regular file"]),
    "dangling link": (weights(kind="dangling"), ["model.safetensors", "dangling symbolic link"]),
    # moot since issue 40: a pytorch_model.bin is never read (no pickle is), so its garbage, truncation, refused
    # pickle, stride-0, shared storage and changed byte have no reader to reach: any is the conversion's one line
    "bin garbage": (weights(b"garbage" * 100, name="pytorch_model.bin"), ["pytorch_model.bin", "never read", CONVERT]),
    "bin refused pickle": (weights(pickled({"w": NotAllowed()}), name="pytorch_model.bin"),
                           ["pytorch_model.bin", "never read", CONVERT]),
    "bin a folder": (weights(kind="folder", name="pytorch_model.bin"), ["pytorch_model.bin", "never read", CONVERT]),
    # issue 33: a weight is never cast from another kind of number, nor backed by bytes another tensor holds
    "integer weights": (entry(EMBED, dtype="I32"), [EMBED, "is I32, not a floating-point weight"]),
    "overlapping tensors": (lambda f: edit_header(f, lambda h: h[LAYER1_BIAS].update(
        data_offsets=h[LAYER0_BIAS]["data_offsets"])), [BROKEN, "invalid offset", "attention.dense.bias"]),
}


@pytest.mark.parametrize("fault", WEIGHT_FAULTS)
def test_weight_file_faults_are_one_line(folder, fault):
    corrupt, words = WEIGHT_FAULTS[fault]
    corrupt(folder)
    load_fails(folder, *words)


# ----------------------------------------------------------------------------------------------
# Tokenizer files


def tokenizer_file(content: bytes | None, kind: str = "file"):
    def apply(path: Path) -> None:
        if kind == "folder":
            path.mkdir()
        elif kind == "dangling":
            path.symlink_to(path.parent / "gone.json")
        else:
            path.write_bytes(content)
    return apply


TOKENIZER_FAULTS = {  # fault: (corrupt, words in load_hf's message, words in load_hf_tokenizer's)
    "not JSON": (tokenizer_file(b"{\"model\": "), ["tokenizer.json", "not valid JSON"],
                 ["tokenizer.json", "not a Hugging Face tokenizer.json"]),
    "empty": (tokenizer_file(b""), ["tokenizer.json", "not valid JSON"],
              ["not a Hugging Face tokenizer.json"]),
    "a list": (tokenizer_file(b"[1, 2]"), ["tokenizer.json", "no \"model\" object"],
               ["not a Hugging Face tokenizer.json"]),
    "no model": (tokenizer_file(b"{\"model\": 3}"), ["no \"model\" object"],
                 ["not a Hugging Face tokenizer.json"]),
    "binary": (tokenizer_file(os.urandom(200) + b"\xff\xfe"), ["tokenizer.json", "not UTF-8"],
               ["not a Hugging Face tokenizer.json"]),
    "nested": (tokenizer_file(b"[" * 100000), ["tokenizer.json", "nested too deeply"],
               ["not a Hugging Face tokenizer.json"]),
    "a folder": (tokenizer_file(None, "folder"), ["tokenizer.json", "is a folder"], ["is a folder"]),
    "dangling": (tokenizer_file(None, "dangling"), ["tokenizer.json", "dangling"], ["dangling"]),
}


@pytest.mark.parametrize("fault", TOKENIZER_FAULTS)
def test_tokenizer_file_faults_are_one_line(folder, fault):
    corrupt, in_folder, alone = TOKENIZER_FAULTS[fault]
    corrupt(folder / "tokenizer.json")
    load_fails(folder, *in_folder)
    with pytest.raises(UserError) as e:
        hf.load_hf_tokenizer(str(folder / "tokenizer.json"))
    one_line(e, *alone)


# ----------------------------------------------------------------------------------------------
# Export


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16))
    path = tmp_path_factory.mktemp("export") / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
               "data_meta": {"tokenizer": "gpt2"}}, path)
    return path


def fail_with(code: int, rust: bool = False):
    def fail(*args, **kwargs):
        if rust:  # how safetensors reports an OS error: its own exception, the errno only in the message
            raise Exception(f"Error while serializing: IoError(Os {{ code: {code}, kind: StorageFull, "
                            f"message: \"{os.strerror(code)}\" }})")
        raise OSError(code, os.strerror(code))
    return fail


def patch(target: str, code: int, rust: bool = False):
    def apply(monkeypatch, tmp_path) -> str:
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, fail_with(code, rust))
        return str(tmp_path / "new" / "deeper" / "hf")
    return apply


def out_is(kind: str):
    def apply(monkeypatch, tmp_path) -> str:
        if kind == "parent a file":
            (tmp_path / "file").write_text("x")
            return str(tmp_path / "file" / "hf")
        if kind == "dot":
            (tmp_path / "empty").mkdir()
            monkeypatch.chdir(tmp_path / "empty")
            return "."
        if kind == "symlink":
            (tmp_path / "target").mkdir()
            (tmp_path / "link").symlink_to(tmp_path / "target")
            return str(tmp_path / "link")
        if kind == "dangling":
            (tmp_path / "link").symlink_to(tmp_path / "gone")
            return str(tmp_path / "link")
        if kind == "a file":
            (tmp_path / "hf").write_text("x")
            return str(tmp_path / "hf")
        raise AssertionError(kind)
    return apply


EXPORT_FAULTS = {
    "disk full": (patch("safetensors.torch.save_file", errno.ENOSPC),
                  ["no space left", "nothing was written"]),
    "disk full (safetensors' error)": (patch("safetensors.torch.save_file", errno.ENOSPC, rust=True),
                                       ["no space left"]),
    "quota": (patch("safetensors.torch.save_file", errno.EDQUOT), ["no space left"]),
    "read-only parent": (patch("os.mkdir", errno.EROFS), ["Read-only file system", "writable folder"]),
    "permission denied": (patch("os.replace", errno.EACCES), ["Permission denied", "nothing was written"]),
    "parent a file": (out_is("parent a file"), ["is a file, not a folder"]),
    "out=.": (out_is("dot"), ["--out=.", "current folder"]),
    "out a symlink": (out_is("symlink"), ["symbolic link"]),
    "out a dangling symlink": (out_is("dangling"), ["symbolic link"]),
    "out a file": (out_is("a file"), ["already exists"]),
}


@pytest.mark.parametrize("fault", EXPORT_FAULTS)
def test_export_faults_are_one_line_and_leave_nothing(small_ckpt, tmp_path, monkeypatch, fault):
    setup, words = EXPORT_FAULTS[fault]
    out = setup(monkeypatch, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UserError) as e:
        hf.main(["export", f"--ckpt={small_ckpt}", f"--out={out}"])
    one_line(e, *words)
    assert sorted(tmp_path.rglob("*")) == before  # no temporary folder, no parent folder left behind


def test_two_exports_at_once_keep_one_complete_folder(small_ckpt, tmp_path, monkeypatch):
    """Each export writes its own temporary folder (named with its process id) and renames it: the one
    that finishes second fails with one line, and the first one's folder stays complete."""
    import safetensors.torch

    real_save = safetensors.torch.save_file
    out = tmp_path / "hf"

    def save_then_race(*args, **kwargs):
        real_save(*args, **kwargs)
        monkeypatch.setattr(safetensors.torch, "save_file", real_save)
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: 4242)  # the other export's process
            hf.export(str(small_ckpt), str(out))  # ... finishes first

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_race)
    with pytest.raises(UserError) as e:
        hf.export(str(small_ckpt), str(out))
    one_line(e, "another", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # neither temporary folder is left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert load_file(out / "model.safetensors")  # complete


def test_exported_files_are_readable_like_any_new_file(small_ckpt, tmp_path):
    (tmp_path / "hf").mkdir()  # an empty folder is replaced by the export
    mask = os.umask(0o022)
    try:
        out = hf.export(str(small_ckpt), str(tmp_path / "hf"))
    finally:
        os.umask(mask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o644)}, modes


# ----------------------------------------------------------------------------------------------
# glue.py rows and checkpoints


STSB = glue.TASKS["stsb"]


@pytest.mark.parametrize("label", [math.nan, math.inf, -math.inf, 1e300, -0.5, 5.5, "3", None, True])
def test_stsb_labels_must_be_finite_and_on_the_0_to_5_scale(label):
    rows = [{"sentence1": "a", "sentence2": "b", "label": 2.5},
            {"sentence1": "a", "sentence2": "b", "label": label}]
    with pytest.raises(UserError) as e:
        glue.check_rows(rows, STSB, "stsb/train.jsonl")
    one_line(e, "stsb/train.jsonl example 2", "label", "[0, 5]")
    assert glue.check_rows(rows[:1] + [{**rows[1], "label": 5}], STSB, "x").tolist() == [2.5, 5.0]


@pytest.fixture(scope="module")
def glue_ckpt(tmp_path_factory) -> Path:
    """A tiny encoder over GPT-2's vocabulary."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=16, n_layer=1, n_head=2, d_model=16, causal=False))
    path = tmp_path_factory.mktemp("glue") / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
               "data_meta": {"tokenizer": "gpt2"}}, path)
    return path


def with_meta(ckpt: Path, tmp_path: Path, **meta) -> Path:
    payload = read_ckpt(ckpt)
    payload["data_meta"] = {**payload["data_meta"], **meta}
    save_ckpt(payload, tmp_path / "meta.safetensors")
    return tmp_path / "meta.safetensors"


GOOD_ROW = '{"sentence1": "a b", "sentence2": "c", "label": 3.0}\n'
GLUE_FAULTS = {  # fault: (train.jsonl text, data_meta changes, words)
    "NaN label": (GOOD_ROW * 2 + '{"sentence1": "a", "sentence2": "b", "label": NaN}\n', {},
                  ["train.jsonl example 3", "nan", "[0, 5]"]),
    "Infinity label": (GOOD_ROW + '{"sentence1": "a", "sentence2": "b", "label": -Infinity}\n', {},
                       ["train.jsonl example 2", "-inf"]),
    "huge label": ('{"sentence1": "a", "sentence2": "b", "label": 1e300}\n', {},
                   ["example 1", "1e+300", "[0, 5]"]),
    "nested line": (GOOD_ROW + "[" * 100000 + "\n", {}, ["train.jsonl line 2", "nested too deeply"]),
    "4000-digit label": (GOOD_ROW + '{"sentence1": "a", "sentence2": "b", "label": 1%s}\n' % ("0" * 4000), {},
                         ["train.jsonl example 2", "[0, 5]"]),
    "5000-digit label": ('{"sentence1": "a", "sentence2": "b", "label": 1%s}\n' % ("0" * 5000), {},
                         ["train.jsonl line 1", "too long"]),
    "eot beyond the vocabulary": (GOOD_ROW, {"eot_token": 60000}, ["eot_token 60000", "0..50303"]),
    "negative eot": (GOOD_ROW, {"eot_token": -1}, ["data_meta.eot_token is -1"]),  # at the checkpoint's door
    "eot not a number": (GOOD_ROW, {"eot_token": "50256"}, ["data_meta.eot_token is '50256', not int"]),
}


@pytest.mark.parametrize("fault", GLUE_FAULTS)
def test_glue_faults_are_one_line(glue_ckpt, tmp_path, fault):
    train_text, meta, words = GLUE_FAULTS[fault]
    data = tmp_path / "stsb"
    data.mkdir()
    (data / "train.jsonl").write_text(train_text)
    (data / "validation.jsonl").write_text(GOOD_ROW)
    ckpt = with_meta(glue_ckpt, tmp_path, **meta) if meta else glue_ckpt
    with pytest.raises(UserError) as e:
        glue.main([f"--ckpt={ckpt}", "--task=stsb", f"--data={data}", "--device=cpu"])
    one_line(e, *words)


def test_glue_refuses_a_tokenizer_larger_than_the_model(tmp_path):
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16, causal=False))
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
               "data_meta": {"tokenizer": "gpt2", "eot_token": 0}}, tmp_path / "small.safetensors")
    data = tmp_path / "stsb"
    data.mkdir()
    (data / "train.jsonl").write_text(GOOD_ROW)
    (data / "validation.jsonl").write_text(GOOD_ROW)
    with pytest.raises(UserError) as e:
        glue.main([f"--ckpt={tmp_path / 'small.safetensors'}", "--task=stsb", f"--data={data}", "--device=cpu"])
    one_line(e, "50257 tokens", "only 64")


# ----------------------------------------------------------------------------------------------
# No large allocation, no hang: hostile folders load in a subprocess whose address space may grow by 1 GiB
# only, and which a timeout ends (a FIFO in place of the weights blocks whoever opens it)


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[1])
    import hf
    from common import UserError

    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    for folder in sys.argv[2:]:
        start = time.perf_counter()
        try:
            hf.load_hf(folder)
            outcome = "loaded"
        except UserError as e:
            outcome = str(e)
        except BaseException as e:  # MemoryError, RuntimeError from a refused allocation...
            outcome = f"CRASH {type(e).__name__}: {e}"
        print(json.dumps([outcome, time.perf_counter() - start]), flush=True)
""")

HOSTILE = {  # case: (corrupt, words)
    "a million layers": (change(num_hidden_layers=1000000), ["num_hidden_layers is 1000000", "2 layers"]),
    "huge hidden_size": (change(hidden_size=1 << 24), ["hidden_size 16777216", "embed_in", "[96, 64]"]),
    "huge vocab_size": (change(vocab_size=1 << 40), ["vocab_size 1099511627776", "embed_in"]),
    "huge intermediate_size": (change(intermediate_size=1 << 30), ["intermediate_size 1073741824"]),
    "huge context": (change(max_position_embeddings=1 << 40), ["max_position_embeddings", "at most 1048576"]),
    "a million layers in a .bin": (lambda f: (to_bin(f), edit_config(f, num_hidden_layers=1000000)),
                                   ["pytorch_model.bin", "never read"]),  # moot since issue 40: no .bin is read
    "a FIFO as the weights": (weights(kind="fifo"), ["model.safetensors", "not a regular file"]),
    # issue 33: these allocated 2 to 4 GiB (and 2.2 GB to read a sparse config.json or tokenizer.json)
    "a 6 kB pytorch_model.bin of stride-0 tensors": (lambda f: stride_zero_bin(f, 1 << 22),
                                                     ["pytorch_model.bin", "never read"]),  # moot, as above
    "a sparse model.safetensors": (lambda f: sparse_safetensors(f, 1 << 22), ["model.safetensors", "sparse file"]),
    "200 layers from one layer's bytes": (lambda f: layers_sharing_bytes(f, 200, 16384),
                                          ["model.safetensors", "not a valid safetensors file", "invalid offset"]),
    "a sparse 900 MB config.json": (lambda f: sparse_file(f / "config.json", 900 << 20),
                                    ["config.json", "more than a config.json can be"]),
    "a sparse 900 MB tokenizer.json": (lambda f: sparse_file(f / "tokenizer.json", 900 << 20),
                                       ["tokenizer.json", "more than a tokenizer.json can be"]),
}


def bin_with(folder: Path, change) -> None:
    """The weights as a pytorch_model.bin, after change(state)."""
    state = load_file(folder / "model.safetensors")
    change(state)
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")


def sparse_file(path: Path, size: int) -> None:
    if not path.exists():
        path.write_text("{")
    os.truncate(path, size)


def stride_zero_bin(folder: Path, vocab_size: int) -> None:
    """config.json's vocabulary grown to 2 GiB of embeddings, each tensor of the .bin expanded from one number."""
    state = load_file(folder / "model.safetensors")
    state = {k: torch.zeros(1).expand((vocab_size, 64) if k in (EMBED, "embed_out.weight") else v.shape)
             for k, v in state.items()}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    edit_config(folder, vocab_size=vocab_size)


def sparse_safetensors(folder: Path, vocab_size: int) -> None:
    """The embeddings grown to vocab_size rows, their bytes a hole: a valid header over a sparse file."""
    def grow(header: dict) -> None:
        end = 0
        for name in sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]):
            if name in (EMBED, "embed_out.weight"):
                header[name]["shape"] = [vocab_size, 64]
            size = math.prod(header[name]["shape"]) * 4
            header[name]["data_offsets"] = [end, end + size]
            end += size
        header["__metadata__"] = {"data": str(end)}
    edit_header(folder, grow)
    data = (folder / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    (folder / "model.safetensors").write_bytes(data[:8 + length])
    os.truncate(folder / "model.safetensors", 8 + length + int(json.loads(data[8:8 + length])["__metadata__"]["data"]))
    edit_config(folder, vocab_size=vocab_size)


def layers_sharing_bytes(folder: Path, n_layer: int, mlp: int) -> None:
    """config.json of n_layer layers with an MLP of mlp channels (8 MB a layer at mlp=16384), every layer's
    tensors pointing at layer 0's bytes: 16 MB of file for a model of 1.6 GB."""
    state = load_file(folder / "model.safetensors")
    for i in (0, 1):
        prefix = f"gpt_neox.layers.{i}.mlp."
        state.update({prefix + "dense_h_to_4h.weight": torch.randn(mlp, 64), prefix + "dense_h_to_4h.bias":
                      torch.randn(mlp), prefix + "dense_4h_to_h.weight": torch.randn(64, mlp)})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

    def copy_layers(header: dict) -> None:
        layer0 = {k: v for k, v in header.items() if k.startswith("gpt_neox.layers.0.")}
        for i in range(1, n_layer):
            header.update({k.replace(".0.", f".{i}.", 1): dict(v) for k, v in layer0.items()})
    edit_header(folder, copy_layers)
    edit_config(folder, num_hidden_layers=n_layer, intermediate_size=mlp)


def test_hostile_folders_allocate_nothing_and_never_hang(valid_folder, tmp_path):
    folders = []
    for i, (corrupt, _) in enumerate(HOSTILE.values()):
        folders.append(Path(shutil.copytree(valid_folder, tmp_path / f"case{i}")))
        corrupt(folders[-1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run([sys.executable, "-c", CHILD, str(REPO), *map(str, folders), str(valid_folder)],
                             capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as e:
        done = len((e.stdout or b"").splitlines())
        raise AssertionError(f"loading hung on case {list(HOSTILE)[done] if done < len(HOSTILE) else done}") from None
    assert run.returncode == 0, run.stderr[-2000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("[")]
    for (case, (_, words)), (outcome, seconds) in zip(HOSTILE.items(), results):
        assert "\n" not in outcome and all(w in outcome for w in words), (case, outcome)
        assert seconds < 1.0, (case, seconds)
    assert results[-1][0] == "loaded"  # the same limit leaves room for a real (tiny) model


def test_export_never_reads_a_tokenizer_file_a_checkpoint_names(small_ckpt, tmp_path):
    """Issue 33: a checkpoint's data_meta naming a tokenizer.json of this machine (and carrying none) made export
    read that file into the exported folder. A path inside a checkpoint is never opened."""
    ckpt = read_ckpt(small_ckpt)
    (tmp_path / "theirs").mkdir()
    bpe.save_tokenizer_json(bpe.train_bpe(["someone else's text"], 260), tmp_path / "theirs" / "tokenizer.json")
    ckpt["data_meta"] = {"tokenizer": str(tmp_path / "theirs" / "tokenizer.json")}
    save_ckpt(ckpt, tmp_path / "ckpt.safetensors")
    with pytest.raises(UserError) as e:
        hf.export(str(tmp_path / "ckpt.safetensors"), str(tmp_path / "hf"))
    one_line(e, "data_meta names its tokenizer by a file", "never opened")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors", "theirs"]


# ----------------------------------------------------------------------------------------------
# Generated variations of a folder: config.json, the safetensors header, any byte, or the weights as a .bin whose
# tensors changed (never read since issue 40: refused in one line, whatever its tensors). generate.py
# --ckpt=hf:FOLDER works, or refuses in one line (exit 2), in a worker whose memory may grow by 1 GiB only, leaving
# the folder as it was. (safetensors has no checksum: a changed tensor byte is another model, so only a refusal or
# a run is asked of it.)


@pytest.fixture(scope="module")
def speaking(tmp_path_factory) -> dict:
    """A tiny GPT-NeoX folder with a tokenizer.json of its own (bpe:260 in a vocabulary of 320), and a worker."""
    folder = tmp_path_factory.mktemp("speaking") / "model"
    random_neox(folder, vocab_size=320, max_position_embeddings=64)
    bpe.save_tokenizer_json(bpe.train_bpe(["the quick brown fox jumps over the lazy dog. " * 5], 260),
                            folder / "tokenizer.json")
    worker = Worker(("generate",))
    ran = worker.run("generate", [f"--ckpt=hf:{folder}", *GENERATE], folder.parent)
    assert ran["code"] == 0, ran
    yield {"folder": folder, "worker": worker}
    worker.close()


GENERATE = ["--prompt=the", "--max_new_tokens=2", "--temperature=0", "--device=cpu"]
ODD = st.sampled_from([None, True, 0, 1, -1, 2.5, 64, 320, 10**12, 10**400, "64", "", [], [1], {}, [0, 10**12],
                       [320, 64], "F16", "I32", "BOOL", "F64", "gpt_neox", "gelu_new"])
CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings", "rotary_pct", "layer_norm_eps", "tie_word_embeddings", "model_type",
               "hidden_act", "use_parallel_residual"]
HF_CHANGES = st.one_of(
    st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS), ODD),
    st.tuples(st.just("header"), st.integers(0, 10**6), st.sampled_from(["dtype", "shape", "data_offsets"]), ODD),
    st.tuples(st.just("bytes"), st.sampled_from(["config.json", "model.safetensors", "tokenizer.json"]),
              st.sampled_from(["flip", "cut", "append"]), st.floats(0, 1)),
    st.tuples(st.just("bin"), st.integers(0, 10**6),
              st.sampled_from(["stride-0", "int", "bool", "shared", "transposed", "half", "sparse", "none"]), ODD))


def changed_folder(source: Path, folder: Path, change: tuple) -> None:
    shutil.copytree(source, folder)
    kind = change[0]
    if kind == "config":
        edit_config(folder, **{change[1]: change[2]})
    elif kind == "header":
        def set_field(header: dict) -> None:
            names = sorted(k for k in header if k != "__metadata__")
            header[names[change[1] % len(names)]][change[2]] = change[3]
        edit_header(folder, set_field)
    elif kind == "bytes":
        path = folder / change[1]
        raw = path.read_bytes()
        at = min(int(change[3] * len(raw)), len(raw) - 1)
        changed = {"flip": raw[:at] + bytes([raw[at] ^ 0x20]) + raw[at + 1:], "cut": raw[:at],
                   "append": raw + b"\x00\xff"}[change[2]]
        path.write_bytes(changed)
    else:
        def tensor_change(state: dict) -> None:
            names = sorted(state)
            name, other = names[change[1] % len(names)], names[(change[1] + 1) % len(names)]
            t = state[name]
            state[name] = {"stride-0": lambda: t.reshape(-1)[:1].expand(t.shape), "int": lambda: t.to(torch.int32),
                           "bool": lambda: t.bool(), "shared": lambda: state[other], "half": lambda: t.half(),
                           "transposed": lambda: t.t() if t.dim() == 2 else t, "sparse": lambda: t.to_sparse(),
                           "none": lambda: t}[change[2]]()
        bin_with(folder, tensor_change)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(change=HF_CHANGES)
def test_any_change_of_a_folder_keeps_generate_to_the_contract(change, speaking):
    work = Path(tempfile.mkdtemp(dir=speaking["folder"].parent))
    changed_folder(speaking["folder"], work / "model", change)
    before = snapshot(work)
    result = speaking["worker"].run("generate", [f"--ckpt=hf:{work / 'model'}", *GENERATE], work, timeout=60)
    assert result["code"] in (0, 2) and "Traceback" not in result["err"] + result["out"], result
    if result["code"] == 2:
        one_line_refusal(result)
    assert snapshot(work) == before

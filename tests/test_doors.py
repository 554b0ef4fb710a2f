"""The file doors (issue 27): each case of the fault-injection pass, grouped by door and table-driven. A case is
checked as a user sees it where that is cheap: `python SCRIPT.py` run in-process, one `error:` line, exit code 2,
no traceback, nothing changed or left behind. Large inputs are stand-ins (a sparse file, a safetensors header that
claims more than the file holds); what a refusal costs in memory and time is measured in one subprocess.
Case numbers are issue 27's ("26.6": issue 26's sixth)."""
from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import DELETE, run_cli, save_ckpt, snapshot
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

import analyze
import bench
import bpe
import checkpoint
import checkpoint_format
import cli
import common
import compare
import data
import doors
import eval as evaluation
import finetune
import generate
import glue
import hf
import io_checks
import model
import prepare
import safe_files
import tokenizer
import train
import xnli
from common import UserError

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--preset=tiny", "--block_size=16", "--batch_size=2", "--max_iters=1", "--eval_batches=1", "--device=cpu"]


def refused(main, argv: list[str], words: str, monkeypatch, capsys, folder: Path | None = None) -> str:
    """`python SCRIPT.py ARGV` exits 2 with one error line holding `words`; `folder` is left as it was."""
    before = snapshot(folder) if folder else None
    code, out, err = run_cli(main, argv, monkeypatch, capsys)
    assert code == 2 and err.startswith("error: ") and words in err, (code, err)
    assert "Traceback" not in out + err
    if folder:
        assert snapshot(folder) == before
    return err


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def checkpoint_dict() -> dict:
    """A checkpoint as today's train.py writes it, every key of it, around a tiny model (block_size 16)."""
    torch.manual_seed(0)
    config = model.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16)
    net = model.GPT(config)
    optimizer = model.adamw(net, 1e-3, 0.1, (0.9, 0.95))
    state = dict(step=4, micro_batches=4, tokens=128, flops=1.0e6, earlier_tokens=0, earlier_flops=0.0, loss=3.5,
                 first_val={"val_ce": 4.0}, val={"val_ce": 3.0}, val_step=4)
    return {"model": net.state_dict(), "model_config": vars(config).copy(), "objective": {},
            "optimizer": optimizer.state_dict(), "scaler": None, "state": state, "mask_spec": None,
            "tokenizer_json": None, "mix": None, "run_id": "0123456789ab",
            "train_config": {"dataset": "shakespeare", "preset": "tiny", "block_size": 16, "batch_size": 2,
                             "max_iters": 4, "loss": "ce", "objective": "causal", "device": "cpu", "seed": 0},
            "data_meta": {"tokenizer": "gpt2", "tokenizer_sha256": None, "vocab_size": 50, "dtype": "uint16",
                          "eot_token": 49, "format": 3},
            "rng": {"torch": torch.get_rng_state(), "cuda": None},
            "init": {"seed": 0, "model_config": vars(config).copy()}}


def edited(ckpt: dict, path: str, value) -> dict:
    """A deep copy of ckpt with the field at `path` ("state/step") set to value (or removed: DELETE)."""
    ckpt = copy.deepcopy(ckpt)
    *parents, key = path.split("/")
    table = ckpt
    for name in parents:
        table = table[name]
    if value is DELETE:
        del table[key]
    else:
        table[key] = value
    return ckpt


CHECKPOINT_FIELDS = [  # (case, field, value, what the one line says)
    ("4", "model_config/block_size", 10**10, "model_config.block_size is 10000000000, outside [2, 1048576]"),
    ("4", "model_config/block_size", 10**8, "model_config.block_size is 100000000, outside"),
    ("10", "step", -5, "in an earlier layout of this project's (counts beside its state: step)"),
    ("10", "state/step", -5, "state.step is -5, outside"),
    ("10", "model_config/gelu", "fast", "model_config.gelu is 'fast', not one of: exact, tanh"),
    ("10", "model_config/norm", "batchnorm", "model_config.norm is 'batchnorm', not one of: layernorm, rmsnorm"),
    ("11", "model_config/n_head", 3, "model_config.d_model 16 is not a multiple of n_head 3"),
    ("11", "model_config/n_head", 0, "model_config.n_head is 0, outside [1, 1024]"),
    ("11", "model_config/block_size", -5, "model_config.block_size is -5, outside"),
    ("11", "model_config/rotary_pct", 5, "model_config.rotary_pct is 5, outside [0, 1]"),
    ("11", "model_config/causal", "no", "model_config.causal is 'no', not bool"),
    ("11", "model_config/bogus", 1, "model_config.bogus is not a field of this code's"),
    ("11", "model/wte.weight", [1.0, 2.0], "model.wte.weight is [1.0, 2.0], not Tensor"),
    ("11", "train_config", None, "train_config is None, not a table"),
    ("11", "train_config", [1, 2], "train_config is [1, 2], not a table"),
    ("11", "train_config/block_size", 1000, "train_config.block_size is more than the model's 16 tokens"),
    ("11", "train_config/batch_size", "abc", "train_config.batch_size is 'abc', not int"),
    ("11", "train_config/max_iters", "abc", "train_config.max_iters is 'abc', not int"),
    ("11", "train_config/device", "tpu", "train_config.device is 'tpu', not one of"),
    ("11", "data_meta", [1], "data_meta is [1], not a table"),
    ("11", "data_meta/tokenizer", 5, "data_meta.tokenizer is 5, not str"),
    ("11", "data_meta/dtype", "float16", "data_meta dtype is 'float16', but 50 tokens are stored as uint16"),
    ("11", "state/bogus", 1, "state.bogus is not a field of this code's"),
    ("11", "state", [1], "state is [1], not a table"),
    ("11", "state/micro_batches", -1, "state.micro_batches is -1, outside"),
    ("11", "rng", DELETE, "lacks rng"),
    ("11", "rng/torch", torch.zeros(7, dtype=torch.uint8), "rng.torch is not the state of torch's generator"),
    ("11", "step", "5", "in an earlier layout of this project's (counts beside its state: step)"),
    ("11", "tokenizer_json", 5, "tokenizer_json is 5, not str"),
    ("11", "init", "seed 3", "init is 'seed 3', not a table"),
    ("11", "init/seed", -1, "init.seed is -1, outside"),
    ("11", "init/model_config", DELETE, "init lacks model_config"),
    ("11", "init/model_config/n_head", 3, "init.model_config.d_model 16 is not a multiple of n_head 3"),
    ("11", "init/model_config/bogus", 1, "init.model_config.bogus is not a field of this code's"),
    # issue 48: every float finite, every metric table a table of numbers, every count in range
    ("48", "state/first_val/val_ce", float("nan"), "state.first_val.val_ce is nan, not a finite number"),
    ("48", "state/val/val_ce", float("inf"), "state.val.val_ce is inf, not a finite number"),
    ("48", "state/loss", float("-inf"), "state.loss is -inf, not a finite number"),
    ("48", "state/flops", float("nan"), "state.flops is nan, not a finite number"),
    ("48", "state/earlier_flops", float("inf"), "state.earlier_flops is inf, not a finite number"),
    # issue 55: a count beyond its declared top names that top (it said "outside [0, inf)")
    ("55", "state/flops", 1e300, "state.flops is 1e+300, outside [0, 1e+30]"),
    ("55", "state/step", 2**70, "state.step is 1180591620717411303424, outside [0, 4611686018427387904]"),
    ("48", "model_config/dropout", float("nan"), "model_config.dropout is nan, not a finite number"),
    ("48", "init/model_config/norm_eps", float("inf"), "init.model_config.norm_eps is inf, not a finite number"),
    ("48", "mix", {"a": float("nan")}, "mix.a is nan, not a finite number"),
    ("48", "train_config/lr", float("nan"), "train_config.lr is nan, not a finite number"),
    ("48", "train_config/beta1", float("inf"), "train_config.beta1 is inf, not a finite number"),
    ("48", "data_meta/val_tokens", float("nan"), "data_meta.val_tokens is nan, not int"),
    ("48", "loss", float("nan"), "in an earlier layout of this project's (counts beside its state: loss)"),
    ("48", "state/val", "3.0", "state.val is '3.0', not a table"),
    ("48", "state/first_val", [4.0], "state.first_val is [4.0], not a table"),
    ("48", "state/val/val_ce", "3.0", "state.val.val_ce is '3.0', not float"),
    ("48", "state/val/val_ce", True, "state.val.val_ce is True, not float"),
    ("48", "mix", [0.5], "mix is [0.5], not a table"),
    ("48", "state/tokens", -1, "state.tokens is -1, outside"),
    ("48", "state/val_step", -3, "state.val_step is -3, outside"),
    ("48", "state/earlier_tokens", 2**70, "state.earlier_tokens is 1180591620717411303424, outside"),
    ("48", "state/micro_batches", 1.5, "state.micro_batches is 1.5, not int"),
    ("48", "scaler", {"scale": 1.0}, "scaler lacks growth_factor"),
]


@pytest.mark.parametrize("case, field, value, words", CHECKPOINT_FIELDS,
                         ids=[f"{c}-{f}={v if not isinstance(v, torch.Tensor) else 'tensor'}"
                              for c, f, v, _ in CHECKPOINT_FIELDS])
def test_the_checkpoint_door_refuses_each_bad_field(case, field, value, words, checkpoint_dict, tmp_path,
                                                    monkeypatch, capsys):
    """Each written by the project's own writer (a valid checksum): refused in one line, exit 2, nothing written.
    train_config's fields are TrainConfig's, which a reader with a trainer checks (finetune.py): generate.py and
    the notebook API read them as plain values (a number finite)."""
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(edited(checkpoint_dict, field, value), path)
    if field.startswith("train_config/") and isinstance(value, str):
        refused(finetune.main, [f"--ckpt={path}", f"--out_dir={tmp_path / 'ft'}", "--device=cpu"], words,
                monkeypatch, capsys, tmp_path)
        return
    refused(generate.main, [f"--ckpt={path}", "--prompt=a", "--device=cpu"], words, monkeypatch, capsys, tmp_path)
    with pytest.raises(ValueError, match="checkpoint"):  # the notebook API reads through the same door
        checkpoint.load_model(str(path))


def test_a_flops_count_past_two_to_the_62_passes_the_door(checkpoint_dict, tmp_path):
    """FLOPs are a float count (checkpoint.FLOPS): a GPT-2 124M run past ~6B tokens spends more than 2^62, and its
    own door lets it in, to read and to resume; 1e300, past FLOPS' top (1e30, beyond any run), is refused (above)."""
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(edited(edited(checkpoint_dict, "state/flops", 1e20), "state/earlier_flops", 3e21), path)
    ckpt = checkpoint.load_checkpoint(path)
    checkpoint_format.resumable(path, ckpt)
    assert (ckpt.state.flops, ckpt.state.earlier_flops, ckpt.pretrain_flops()) == (1e20, 3e21, 1e20 + 3e21)


CHECKPOINT_FILES = [  # (case, how the file is made, what the one line says). Case 3's zips (a compressed data.pkl, a
    # directory claiming more than the file) are moot: a checkpoint is safetensors, whose bytes the library checks
    ("3", lambda p, c: p.write_bytes(os.urandom(4096)), "is not a safetensors file"),
    ("3", lambda p, c: torch.save(c, p), "is a torch.save file (a zip), not safetensors; this project's checkpoints "
     "before safetensors (ckpt.pt) are converted once"),
    ("5", lambda p, c: p.symlink_to("/dev/zero"), "is not a regular file"),
    ("5", lambda p, c: os.mkfifo(p), "is not a regular file"),
    ("5", lambda p, c: p.mkdir(), "is a folder"),
    ("old", lambda p, c: save_file({"x": torch.zeros(2)}, p), "is not a headless-lm checkpoint"),
]


@pytest.mark.parametrize("case, make, words", CHECKPOINT_FILES, ids=[f"{c}-{w[:40]}" for c, _, w in CHECKPOINT_FILES])
def test_the_checkpoint_door_refuses_what_is_no_checkpoint_and_never_unpickles(case, make, words, checkpoint_dict,
                                                                               tmp_path, monkeypatch, capsys):
    path = tmp_path / "ckpt.safetensors"
    make(path, checkpoint_dict)
    loaded = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loaded.append(a) or {})
    refused(generate.main, [f"--ckpt={path}", "--prompt=a", "--device=cpu"], words, monkeypatch, capsys, tmp_path)
    assert not loaded


# Any JSON-like value, the awkward ones often: huge, negative or non-finite numbers, strings of digits, nesting
ANY_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 10**12])
                         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
                         | st.sampled_from(["5", "gpt2", "uint8", "float16", "mlm", "exact", "cuda"]),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=3), max_leaves=4)
FIELDS = ([f"model_config/{f}" for f in vars(model.GPTConfig())] + [f"state/{f}" for f in ("step", "tokens", "val")]
          + [f"train_config/{f}" for f in doors.field_rules(train.TrainConfig)]
          + [f"data_meta/{f.name}" for f in dataclasses.fields(doors.DatasetMeta)]
          + [f"state/{f.name}" for f in dataclasses.fields(checkpoint.State)]
          + ["step", "rng", "rng/torch", "model", "objective", "tokenizer_json", "val", "init", "init/seed",
             "init/model_config", "init/model_config/n_head", "state/val/val_ce", "mix", "scaler", "mask_spec"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_any_value_in_any_field_is_let_in_or_refused_in_one_line(checkpoint_dict, field, value):
    """The invariant behind cases 4, 10 and 11: whatever a checkpoint's field holds, its door lets it in (and the
    model is then built, or refused in one line by the weights check) or refuses it in one line."""
    ckpt = edited(checkpoint_dict, field, value)
    why = checkpoint_format.earlier_layout(ckpt)
    why = why or checkpoint_format.checkpoint_problem(ckpt, checkpoint.Checkpoint, train.TrainConfig)
    if why is not None:
        assert isinstance(why, str) and "\n" not in why
        return
    try:
        checkpoint.checkpoint_model(doors.declared(checkpoint.Checkpoint, ckpt), "ckpt.safetensors")
    except UserError as e:
        assert "\n" not in str(e) and "does not match this model code" in str(e)


def test_a_checkpoint_written_by_todays_main_loads(checkpoint_dict, tmp_path):
    """Old files: today's checkpoints (every key train.py writes) go through the door as they are."""
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(checkpoint_dict, path)
    ckpt = checkpoint.load_checkpoint(path, train.TrainConfig)
    assert set(doors.plain(ckpt)) == set(checkpoint_dict) and doors.plain(ckpt.state) == checkpoint_dict["state"]
    assert checkpoint.checkpoint_model(ckpt, path).config.block_size == 16
    assert checkpoint.load_model(str(path)).config == model.GPTConfig(**checkpoint_dict["model_config"])
    assert checkpoint.last_good_checkpoint(path) == f"the last good checkpoint is {path} (step 4)"
    hf_style = {k: checkpoint_dict[k] for k in ("model", "model_config")} | {"data_meta": {}, "train_config": {}}
    save_ckpt(hf_style, path)  # the few keys an imported model has, and an older run's
    assert checkpoint.load_checkpoint(path, train.TrainConfig).train_config == {}


EARLIER_LAYOUTS = [  # (what, the payload of an earlier layout made from today's, what the refusal says of it)
    ("counts beside state", lambda c: {**c, "step": 4, "tokens_seen": 128},
     "counts beside its state: step, tokens_seen"),
    ("counts, no state", lambda c: {**{k: v for k, v in c.items() if k != "state"}, "base_flops": 2.0},
     "counts beside its state: base_flops"),
    ("an import's source", lambda c: {**c, "source": "hf:EleutherAI/pythia-70m"}, "an import's source"),
    ("a disabled scaler's {}", lambda c: {**c, "scaler": {}}, "a disabled scaler as {}"),
    ("a state before val_step", lambda c: {**c, "state": {k: v for k, v in c["state"].items() if k != "val_step"}},
     "a state without val_step"),
]


@pytest.mark.parametrize("what, older, how", EARLIER_LAYOUTS, ids=[w for w, _, _ in EARLIER_LAYOUTS])
def test_a_checkpoint_of_an_earlier_layout_is_refused_naming_what_converts_it(what, older, how, checkpoint_dict,
                                                                               tmp_path, monkeypatch, capsys):
    """One layout is read (no reader of earlier ones): an older file is refused by the door and by a plan's read of
    its document alike, in one line that names convert.py (which upgrades it: tests/test_convert.py)."""
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(older(copy.deepcopy(checkpoint_dict)), path)
    words = f"is in an earlier layout of this project's ({how}), which no script reads; convert it once: "
    err = refused(generate.main, [f"--ckpt={path}", "--prompt=a", "--device=cpu"], words, monkeypatch, capsys, tmp_path)
    assert err.strip().endswith(f"--ckpt={path} --out={tmp_path / 'ckpt-converted.safetensors'}")
    assert "convert.py" in err
    for read in (checkpoint.read_checkpoint, checkpoint.read_document):
        with pytest.raises(doors.Refused, match=re.escape(words)):
            read(path, train.TrainConfig)


def test_a_tokenizer_that_would_be_downloaded_is_one_line(checkpoint_dict, tmp_path, monkeypatch, capsys):
    """Case 11: data_meta names tiktoken's cl100k_base, which tiktoken downloads on first use (88 lines of
    ConnectionError offline): refused in one line naming the offline tokenizers and hf:, never fetched."""
    def fetched(name):
        raise AssertionError("a tokenizer was fetched")

    monkeypatch.setattr(tokenizer.tiktoken, "get_encoding", fetched)
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(edited(checkpoint_dict, "data_meta/tokenizer", "cl100k_base"), path)
    refused(generate.main, [f"--ckpt={path}", "--prompt=a", "--device=cpu"], "unknown tokenizer 'cl100k_base'",
            monkeypatch, capsys)
    refused(prepare.main, ["--tokenizer=cl100k_base", f"--data_root={tmp_path / 'd'}"], "hf:ORG/NAME",
            monkeypatch, capsys)
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------------------------------ datasets


def meta_edit(**changes):
    def edit(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, **changes}))
    return edit


def as_uint8(folder: Path) -> None:
    """Case 10: dtype uint8 with every count doubled: the same bytes, so size and checksum agree."""
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(dtype="uint8", train_tokens=2 * meta["train_tokens"], val_tokens=2 * meta["val_tokens"])
    (folder / "meta.json").write_text(json.dumps(meta))


def replace_meta(how):
    def edit(folder: Path) -> None:
        (folder / "meta.json").unlink()
        how(folder / "meta.json")
    return edit


DATASET_CASES = [  # (case, edit, what the one line says)
    ("5", meta_edit(vocab_size=10**12), "vocab_size is 1000000000000, outside [1, 4194304]"),
    ("5", replace_meta(lambda p: p.symlink_to("/dev/zero")), "meta.json is not a regular file"),
    ("5", replace_meta(os.mkfifo), "meta.json is not a regular file"),
    ("10", as_uint8, "dtype is 'uint8', but 50257 tokens are stored as uint16"),
    ("12", meta_edit(vocab_size="50257"), "vocab_size is '50257', not int"),
    ("12", meta_edit(dtype="float16"), "dtype is 'float16'"),
    ("12", meta_edit(dtype="int8"), "dtype is 'int8'"),
    ("12", meta_edit(dtype="nonsense"), "dtype is 'nonsense'"),
    ("12", meta_edit(checksums=None), "checksums is None, not a table"),
    ("12", meta_edit(checksums={"train": "x"}), "checksums is {'train': 'x'}, not the sha256"),
    ("12", meta_edit(format=4), "format is 4, not one of: 3"),
    ("12", replace_meta(lambda p: p.mkdir()), "meta.json is a folder"),
    ("12", lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json is not the tokenizer gpt2"),
    ("55", meta_edit(documents=2**70), "documents is 1180591620717411303424, outside [0, 4611686018427387904]"),
]


@pytest.mark.parametrize("case, edit, words", DATASET_CASES, ids=[f"{c}-{w[:30]}" for c, _, w in DATASET_CASES])
def test_the_dataset_door_refuses_each_bad_field_or_file(case, edit, words, tiny_data_dir, tmp_path, monkeypatch,
                                                          capsys):
    folder = Path(shutil.copytree(tiny_data_dir, tmp_path / "d" / "books"))
    edit(folder)
    with pytest.raises(UserError) as e:
        data.open_split(folder, "train", 50304)
    assert words in str(e.value) and "\n" not in str(e.value)
    refused(train.main, [f"--dataset={folder}", f"--out_dir={tmp_path / 'o'}", *TRAIN], words, monkeypatch,
            capsys, tmp_path / "d")
    assert not (tmp_path / "o").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from([f.name for f in dataclasses.fields(doors.DatasetMeta)] + ["checksums/train",
                                                                                    "settings/dataset"]),
       value=ANY_VALUE)
def test_any_value_in_any_meta_field_is_let_in_or_refused_in_one_line(dataset_copy, field, value):
    """The same invariant at the dataset door (cases 5, 10, 12): meta.json as a table of anything."""
    folder, meta = dataset_copy
    (folder / "meta.json").write_text(json.dumps(edited(meta, field, value)))
    try:
        doors.dataset(folder, ("train.bin", "val.bin", "val.bytes"), 50304)
    except doors.Refused as e:
        assert "\n" not in str(e)


@pytest.fixture(scope="module")
def dataset_copy(tiny_data_dir, tmp_path_factory) -> tuple[Path, dict]:
    folder = Path(shutil.copytree(tiny_data_dir, tmp_path_factory.mktemp("doors") / "books"))
    return folder, data.load_meta(folder)


def test_a_swapped_tokenizer_json_is_refused_and_never_carried(tmp_path, monkeypatch, capsys):
    """Case 9: meta.json's sha256 of tokenizer.json is checked: a swapped file (another valid tokenizer) neither
    trains nor reaches a checkpoint."""
    root = tmp_path / "d"
    prepare.prepare(prepare.PrepareConfig(dataset=str(small_corpus(tmp_path / "corpus")), tokenizer="bpe:260",
                                    data_root=str(root)))
    folder = root / "corpus-bpe260"
    assert tokenizer.dataset_tokenizer(folder).n_vocab == 260
    bpe.save_tokenizer_json(bpe.train_bpe(["another text, another tokenizer"], 260), folder / "tokenizer.json")
    refused(train.main, [f"--dataset={folder}", f"--out_dir={tmp_path / 'o'}", *TRAIN],
            "tokenizer.json is not the tokenizer bpe:260 that meta.json records", monkeypatch, capsys, root)
    assert not (tmp_path / "o" / "ckpt.safetensors").exists()


def test_a_dataset_written_by_todays_main_loads_and_an_older_one_names_its_fix(tiny_data_dir, tmp_path):
    """Old files: a format-3 meta.json with exactly the fields today's data.py writes loads; an older format is
    refused in one line naming the command that prepares it again."""
    meta = data.load_meta(tiny_data_dir)
    assert sorted(meta) == ["checksums", "documents", "dtype", "eot_token", "format", "mask_token", "settings",
                            "skipped_rows", "source", "source_id", "special_tokens", "tokenizer", "tokenizer_sha256",
                            "train_tokens", "val_bytes", "val_tokens", "vocab_size"]
    folder = Path(shutil.copytree(tiny_data_dir, tmp_path / "books"))
    meta_edit(format=2)(folder)
    with pytest.raises(UserError, match=r"prepared before val.bytes .* python prepare.py --dataset=shakespeare"):
        data.load_meta(folder)


# ------------------------------------------------------------------------------------------ settings and flags


def sparse(size: int, suffix: str):
    def make(tmp_path: Path) -> Path:
        path = tmp_path / f"big{suffix}"
        with open(path, "wb") as f:
            f.truncate(size)  # no blocks on disk: a 10 GB file that costs nothing to make (and is never read)
        return path
    return make


def fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "pipe.json")
    return tmp_path / "pipe.json"


SETTINGS_CASES = [  # (case, the flags (a function of tmp_path), what the one line says)
    ("6", lambda t: [f"--config={sparse(10 << 30, '.json')(t)}"], "is 10,737,418,240 bytes, more than"),
    ("6", lambda t: [f"--config={sparse(10 << 30, '.toml')(t)}"], "is 10,737,418,240 bytes, more than"),
    ("6", lambda t: [f"--config={sparse(2 << 30, '.json')(t)}"], "is 2,147,483,648 bytes, more than"),
    ("6", lambda t: [f"--config={fifo(t)}"], "is not a regular file"),
    ("10", lambda t: ["--out_dir="], "must be given (not empty)"),
    ("14", lambda t: ["--seed=-1"], "--seed must be in [0, 4294967295], got -1"),
    ("14", lambda t: ["--seed=1e20"], "--seed must be in [0, 4294967295]"),
    ("14", lambda t: ["--block_size=1e10"], "--block_size must be in [2, 1048576], got 10000000000"),
    ("15", lambda t: ["--dataset=shakespeare,"], "each name of --dataset must be given (not empty)"),
    ("15", lambda t: ["--resume", "--overwrite"], "pass one of them"),
]


@pytest.mark.parametrize("case, flags, words", SETTINGS_CASES, ids=[f"{c}-{w[:40]}" for c, _, w in SETTINGS_CASES])
def test_settings_are_refused_before_anything_is_written(case, flags, words, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"  # the current folder, which --out_dir= would be; the config files lie beside it
    work.mkdir()
    (work / "keep.txt").write_text("a user's file")
    monkeypatch.chdir(work)
    refused(train.main, [f"--out_dir={work / 'o'}", f"--data_root={work / 'data'}", *flags(tmp_path)],
            words, monkeypatch, capsys, work)


def test_a_micro_batch_larger_than_the_training_split_is_refused(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """Case 14: --batch_size=1e8 (5e7 x 32 tokens was killed at 23 GB): more than the split, one line at once.
    (1e8 is now past --batch_size's bound, doors.COUNTS; 60,000 is within it but more than this split.)"""
    refused(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={tmp_path / 'o'}", *TRAIN, "--batch_size=60000"],
            "block_size=16 x batch_size=60000 needs 960000 tokens; the split holds", monkeypatch, capsys)
    assert not (tmp_path / "o" / "log.jsonl").exists()


@pytest.mark.parametrize("name", ["bpe:２５７", "bpe:" + "1" + "0" * 23, f"bpe:{2**64 + 1}", "bpe:1000000000"])
def test_bpe_sizes_no_vocabulary_has_are_refused_before_any_work(name, tmp_path, monkeypatch, capsys):
    """Cases 10 and 14: full-width digits (the folder was named shakespeare-bpe), 10^23 and 2^64 + 1 (an
    OverflowError), 10^9 (the tokenizer library aborted after 70 GB, leaving a .lock)."""
    refused(prepare.main, [f"--tokenizer={name}", f"--data_root={tmp_path / 'd'}"], "N must be a whole number",
            monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []


def test_finetune_refuses_a_block_size_beyond_the_checkpoints_before_preparing_data(checkpoint_dict, tmp_path,
                                                                                   monkeypatch, capsys):
    """Case 10: finetune.py's bad --block_size used to prepare the built-in dataset before refusing."""
    save_ckpt(checkpoint_dict, tmp_path / "ckpt.safetensors")
    refused(finetune.main, [f"--ckpt={tmp_path / 'ckpt.safetensors'}", "--block_size=1000",
                            f"--data_root={tmp_path / 'd'}", f"--out_dir={tmp_path / 'o'}"],
            "--block_size must be in [2, 16], got 1000",
            monkeypatch, capsys, tmp_path)


# ------------------------------------------------------------------------------------------ outputs


def output_cases(tmp_path: Path) -> list[tuple]:
    """Case 7 and its relatives: (script, flags, what the one line says); CKPT is a checkpoint, an input."""
    ckpt = tmp_path / "ckpt.safetensors"
    (tmp_path / "notes.txt").write_text("a user's notes")
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.txt")
    (tmp_path / "plot.png").write_text("not an image")
    os.mkfifo(tmp_path / "pipe.json")
    return [(evaluation.main, [f"--ckpt={ckpt}", f"--json={ckpt}"], "is also an input of this command"),
            (glue.main, [f"--ckpt={ckpt}", f"--json={ckpt}", "--task=rte"], "is also an input of this command"),
            (bpe.main, [f"--out={ckpt}", "--vocab_size=300"], "exists and is not a tokenizer.json"),
            (evaluation.main, [f"--ckpt={tmp_path / 'other.pt'}", f"--json={tmp_path / 'notes.txt'}"],
             "exists and is not results"),
            (evaluation.main, [f"--ckpt={ckpt}", f"--json={tmp_path / 'link.json'}"], "is a symbolic link"),
            (evaluation.main, [f"--ckpt={ckpt}", f"--json={tmp_path / 'pipe.json'}"], "exists and is not results"),
            (evaluation.main, [f"--ckpt={ckpt}", f"--json={tmp_path / 'ckpt.safetensors' / 'x.json'}"], "is a file")]


def test_an_output_is_never_an_input_a_link_or_another_kind_of_file(checkpoint_dict, tmp_path, monkeypatch, capsys):
    save_ckpt(checkpoint_dict, tmp_path / "ckpt.safetensors")
    for main, flags, words in output_cases(tmp_path):
        refused(main, flags, words, monkeypatch, capsys, tmp_path)
    (tmp_path / "old.json").write_text('{\n "task": "val",\n "ce": 3.0\n}\n')  # as write_json lays it out
    (tmp_path / "empty.json").write_text("")
    for name in ("old.json", "empty.json", "new.json"):  # replaced
        io_checks.declare_io(reads={"--ckpt": str(tmp_path / "ckpt.safetensors")}, writes={"--json": tmp_path / name})


# ------------------------------------------------------------------------------------------ files we write


def test_the_locks_info_is_never_written_through_a_planted_link(tmp_path):
    """Case 1: `ln -s ~/notes.txt o/.lock; train.py --out_dir=o` wrote "pid ..." into notes.txt."""
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / ".lock").symlink_to(victim)
    with pytest.raises(UserError, match=r"o/\.lock is a link or a folder, not a lock file; move it away$"):
        with safe_files.hold_lock(tmp_path / "o", "training run"):
            pass
    assert victim.read_text() == "my notes" and (tmp_path / "o" / ".lock").is_symlink()


def test_temp_files_are_new_files_whose_names_cannot_be_planted(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """Case 2: links planted at `.ckpt.safetensors.headless-lm-<pid>.tmp` for a range of pids made the victim the
    checkpoint. Names now carry a random part; even at a planted name the file is opened O_EXCL|O_NOFOLLOW.
    (And case 1 through train.py: a link planted as the out_dir's .lock.)"""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "o"
    out.mkdir()
    for pid in range(os.getpid() - 50, os.getpid() + 50):
        (out / f".ckpt.safetensors{safe_files.TEMP_MARK}{pid}.tmp").symlink_to(victim)
    (out / ".lock").symlink_to(victim)  # case 1 as a user met it: through train.py (refused, never written through)
    refused(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={out}", *TRAIN], "is a link or a folder, not a "
            "lock file", monkeypatch, capsys)
    (out / ".lock").unlink()
    train.main([f"--dataset={tiny_data_dir}", f"--out_dir={out}", *TRAIN])
    ckpt = out / "ckpt.safetensors"
    assert victim.read_text() == "precious" and ckpt.is_file() and not ckpt.is_symlink()
    assert (out / ".lock").read_bytes() == b""  # released: names nobody
    monkeypatch.setattr(safe_files.secrets, "token_hex", lambda n: "0" * 2 * n)  # a name known in advance
    planted = safe_files.temp_path(tmp_path / "results.json")
    planted.symlink_to(victim)
    with pytest.raises(UserError, match="cannot write .File exists. while saving"):
        with safe_files.atomic_file(tmp_path / "results.json", "w") as f:
            f.write("results")
    assert victim.read_text() == "precious" and not (tmp_path / "results.json").exists()


def small_corpus(folder: Path) -> Path:
    """Two documents, one of each split (the folder's own train and validation files): bpe:260 in no time."""
    folder.mkdir(parents=True)
    (folder / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    (folder / "validation.txt").write_text("a lazy dog sleeps in the sun by the quick brown fox. " * 5)
    return folder


@pytest.mark.parametrize("stop_in", ["train_bpe", "save_tokenizer_json", "encode_batches", "write_meta", "rename"])
def test_an_interrupted_bpe_preparation_leaves_the_earlier_dataset_whole(stop_in, tmp_path, monkeypatch):
    """Case 8: Ctrl-C while preparing a bpe dataset over an existing one replaced its tokenizer.json first (4 of
    4 timings). Now the new dataset is built beside it and renamed into place as a unit."""
    settings = dict(dataset=str(small_corpus(tmp_path / "corpus")), tokenizer="bpe:260", data_root=str(tmp_path / "d"))
    prepare.prepare(prepare.PrepareConfig(**settings))
    before = snapshot(tmp_path / "d")
    assert sorted(before) == [f"corpus-bpe260/{f}" for f in ("meta.json", "tokenizer.json", "train.bin", "val.bin",
                                                              "val.bytes")]

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    renames = []
    if stop_in == "rename":  # between taking the earlier dataset away and putting the new one in its place, where
        monkeypatch.setattr(safe_files, "exchange", lambda a, b: False)  # no file system swaps two names in one step
        monkeypatch.setattr(safe_files.os, "rename", lambda a, b: renames.append(a) or (
            stop() if len(renames) == 2 else os.replace(a, b)))
    elif stop_in == "write_meta":
        monkeypatch.setattr(prepare.json, "dumps", stop)
    elif stop_in == "encode_batches":
        monkeypatch.setattr(prepare, stop_in, stop)
    else:
        monkeypatch.setattr(bpe, stop_in, stop)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(prepare.PrepareConfig(**settings))
    assert snapshot(tmp_path / "d") == before  # the dataset, and no temp folder or .lock beside it
    assert len(renames) == (3 if stop_in == "rename" else 0)  # away, (stopped), back


def test_file_system_faults_are_one_line_and_never_masked(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """Case 13: an out_dir on a read-only mount, a full disk at start, a mount that turns read-only mid-save
    (removing the temp file failed too, masking the first error), log.jsonl a folder, bpe.py --out read-only."""
    real_open = os.open

    def failing(errno_: int, where: str):
        def open_(path, flags, *args, **kwargs):
            if where in str(path):
                raise OSError(errno_, os.strerror(errno_), str(path))
            return real_open(path, flags, *args, **kwargs)
        return open_

    flags = [f"--dataset={tiny_data_dir}", f"--out_dir={tmp_path / 'o'}", *TRAIN]
    lock = tmp_path / "o" / ".lock"
    for code, words in ((errno.EROFS, f"cannot take the lock {lock} (Read-only file system); make {lock.parent} "
                                      "writable"),
                        (errno.ENOSPC, f"cannot take the lock {lock} (No space left on device); free some space")):
        monkeypatch.setattr(safe_files.os, "open", failing(code, ".lock"))
        refused(train.main, flags, words, monkeypatch, capsys)
        assert not (tmp_path / "o").exists()  # the folder the lock made is removed again
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):  # removing the temp file fails too, as on a read-only mount
        if str(self).endswith(".tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(safe_files.os, "open", failing(errno.EROFS, ".tmp"))
    monkeypatch.setattr(Path, "unlink", unlink)
    refused(train.main, flags, "cannot write (Read-only file system) while saving", monkeypatch, capsys)
    monkeypatch.undo()
    for extra in (["--overwrite"], ["--resume=auto"]):
        shutil.rmtree(tmp_path / "o", ignore_errors=True)
        (tmp_path / "o" / "log.jsonl").mkdir(parents=True)
        refused(train.main, flags + extra, "log.jsonl is a link, a folder or a special file", monkeypatch, capsys,
                tmp_path / "o")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    refused(bpe.main, [f"--out={tmp_path / 'tok.json'}", "--vocab_size=300"], "is not writable", monkeypatch,
            capsys, tmp_path)


def test_sigterm_while_preparing_data_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Case 15: SIGTERM early in data.py left an empty dataset folder with a .lock. It now unwinds as Ctrl-C
    does (exit 143): the folder and the temp folder beside it are removed."""
    real = prepare.write_shards

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "write_shards", terminated)
    monkeypatch.setattr(sys, "argv", ["prepare.py", "--max_docs=2", f"--data_root={tmp_path / 'd'}"])
    with pytest.raises(SystemExit) as e:
        common.run_main(prepare.main)
    assert e.value.code == 143 and snapshot(tmp_path / "d") == {}  # nothing but the released lock
    assert signal.getsignal(signal.SIGTERM) is not common._terminate


def test_a_killed_exports_temp_folder_is_removed_by_the_next(checkpoint_dict, tmp_path, monkeypatch, capsys):
    """Case 15: kill -9 during `hf.py export` left a temp folder no later export removed; temp names now hold
    the pid, which the sweep checks. `hf.py --help` exits 0."""
    stale = tmp_path / f".hf{safe_files.TEMP_MARK}999999999-0123456789abcdef.tmp"  # pid 999999999: long dead
    (stale / "part").mkdir(parents=True)
    save_ckpt(checkpoint_dict, tmp_path / "ckpt.safetensors")

    def fails(*args):
        raise UserError("stopped while writing the tokenizer")

    monkeypatch.setattr(hf, "save_tokenizer", fails)
    with pytest.raises(UserError, match="stopped while writing"):
        hf.export(str(tmp_path / "ckpt.safetensors"), str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]  # the stale folder and its own, removed
    monkeypatch.setattr(sys, "argv", ["hf.py", "--help"])
    with pytest.raises(SystemExit) as e:
        common.run_main(hf.main)
    assert e.value.code == 0 and "settings (--key=value)" in capsys.readouterr().out


def test_offline_hub_access_is_one_line(monkeypatch, capfd):
    """Case 15: offline, the hub client logged each of its retries (~11 lines) before the one-line error."""
    import huggingface_hub
    from huggingface_hub.utils import logging as hub_logging

    def retrying(*args, **kwargs):
        for n in range(5):
            hub_logging.get_logger("huggingface_hub.utils._http").warning(f"Retrying in 1s [Retry {n + 1}/5].")
        raise ConnectionError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", retrying)
    with pytest.raises(UserError, match="could not get the tokenizer"):
        hf.load_hf_tokenizer("hf:EleutherAI/pythia-70m")
    assert "Retrying" not in capfd.readouterr().err


# ------------------------------------------------------------------------------------------ 26.6


def test_two_tokenizers_of_one_folder_name_never_replace_each_others_dataset(tmp_path, monkeypatch, capsys):
    """Issue 26.6: tokA/mytok/tokenizer.json then tokB/mytok/tokenizer.json both map to data/corpus-mytok;
    the second preparation replaced the first. meta.json records the sha256, and the second is refused."""
    for name, text in (("tokA", "the first tokenizer's text"), ("tokB", "another text altogether")):
        (tmp_path / name / "mytok").mkdir(parents=True)
        bpe.save_tokenizer_json(bpe.train_bpe([text], 260), tmp_path / name / "mytok" / "tokenizer.json")
    flags = [f"--dataset={small_corpus(tmp_path / 'corpus')}", f"--data_root={tmp_path / 'd'}"]
    prepare.main([*flags, f"--tokenizer={tmp_path / 'tokA' / 'mytok' / 'tokenizer.json'}"])
    prepare.main([*flags, f"--tokenizer={tmp_path / 'tokA' / 'mytok' / 'tokenizer.json'}"])  # the same: prepared again
    err = refused(prepare.main, [*flags, f"--tokenizer={tmp_path / 'tokB' / 'mytok' / 'tokenizer.json'}"],
                  "holds a dataset of another tokenizer", monkeypatch, capsys, tmp_path / "d")
    assert "pass --name=NAME" in err
    assert data.load_meta(tmp_path / "d" / "corpus-mytok")["tokenizer"].startswith(str(tmp_path / "tokA"))


# ------------------------------------------------------------------------------------------ cost of a refusal

COSTLY = r"""
import json, os, resource, sys, time
sys.path.insert(0, ROOT)
import torch
import checkpoint, checkpoint_format, cli, common, data, doors, model, train
from common import UserError
tmp = TMP
cases = {}
def timed(name, read):
    start = time.time()
    try:
        read()
        cases[name] = "accepted"
    except UserError as e:
        cases[name] = [time.time() - start, str(e)[:80]]
def config(size, suffix):
    path = os.path.join(tmp, "big" + suffix)
    with open(path, "wb") as f:
        f.truncate(size)
    return lambda: cli.parse_flags(__import__("train").TrainConfig, ["--config=" + path])
timed("6: a 10 GB sparse --config", config(10 << 30, ".toml"))
timed("6: a 2 GB sparse --config", config(2 << 30, ".json"))
net = model.GPT(model.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16))
ckpt = {"model": net.state_dict(), "model_config": {"vocab_size": 64, "block_size": 10**10, "n_layer": 1,
        "n_head": 2, "d_model": 16}}
with open(os.path.join(tmp, "long.safetensors"), "wb") as f:
    f.writelines(checkpoint_format.checkpoint_bytes(ckpt))
timed("4: block_size 1e10", lambda: checkpoint.load_checkpoint(f.name, train.TrainConfig))
header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]}}).encode()
with open(os.path.join(tmp, "claim.safetensors"), "wb") as f:  # 10 kB claiming a 4 GiB tensor
    f.write(len(header).to_bytes(8, "little") + header + bytes(10_000))
timed("3: a 10 kB file claiming a 4 GiB tensor", lambda: checkpoint.load_checkpoint(f.name, train.TrainConfig))
folder = os.path.join(tmp, "books")
os.makedirs(folder)
meta = {"format": 3, "tokenizer": "gpt2", "vocab_size": 10**12, "dtype": "uint32", "eot_token": 0,
        "train_tokens": 1, "val_tokens": 1, "val_bytes": 0, "checksums": {}}
open(os.path.join(folder, "meta.json"), "w").write(json.dumps(meta))
timed("5: vocab_size 10^12", lambda: data.open_split(folder, "train"))
os.remove(os.path.join(folder, "meta.json"))
os.symlink("/dev/zero", os.path.join(folder, "meta.json"))
timed("5: meta.json a link to /dev/zero", lambda: data.load_meta(folder))
os.remove(os.path.join(folder, "meta.json"))
os.mkfifo(os.path.join(folder, "meta.json"))
timed("5: meta.json a FIFO", lambda: data.load_meta(folder))
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cases": cases}))
"""


def test_a_refused_input_costs_little_memory_and_time(tmp_path):
    """Done when: a refused input costs under 1.5 GiB peak memory and under 30 s (one process for them all, so
    its peak bounds each; torch's own import is part of it)."""
    script = COSTLY.replace("ROOT", repr(str(ROOT))).replace("TMP", repr(str(tmp_path)))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(case != "accepted" and case[0] < 30 for case in report["cases"].values()), report
    assert len(report["cases"]) == 7 and report["peak_mib"] < 1536, report


def test_a_missing_checkpoint_names_the_step_that_writes_it(tmp_path):
    """`generate.py --ckpt=out-ft/ckpt.safetensors` before the fine-tune: the answer names finetune.py, not only
    train.py."""
    with pytest.raises(doors.Refused, match=r"out-ft/ckpt.safetensors not found; train.py writes out/ckpt.safetensors "
                                            r"and `finetune.py --ckpt=out/ckpt.safetensors` writes "
                                            r"out-ft/ckpt.safetensors: run the step that makes it"):
        checkpoint.read_checkpoint(tmp_path / "out-ft" / "ckpt.safetensors", train.TrainConfig)


def test_none_is_a_value_where_a_literal_has_it_and_null_elsewhere():
    """Issue 39: "unset" is not a string. A fork's `qk_norm: Literal["none", "rms"] | None` takes --qk_norm=none as
    its value "none"; an optional number takes none/null/"" as None."""
    from typing import Literal
    assert cli.coerce("qk_norm", "none", Literal["none", "rms"] | None) == "none"
    assert cli.coerce("qk_norm", "rms", Literal["none", "rms"] | None) == "rms"
    assert cli.coerce("mlp_hidden", "none", int | None) is None
    assert cli.coerce("mlp_hidden", None, int | None) is None
    assert cli.coerce("mlp_hidden", "7", int | None) == 7


def test_the_settings_given_are_the_flags_and_the_config_files_not_the_defaults(tmp_path):
    """Issue 39: parse_given names what the user gave, on the command line or in a --config file; --quick's values
    and the defaults are not given."""
    config = tmp_path / "run.toml"
    config.write_text("seed = 3\nbatch_size = 4\n")
    cfg, given = cli.parse_given(train.TrainConfig, [f"--config={config}", "--lr=0.01", "--batch_size=8"])
    assert (cfg.seed, cfg.batch_size, cfg.lr) == (3, 8, 0.01)
    assert given == {"seed", "batch_size", "lr"}
    cfg, given = cli.parse_given(train.TrainConfig, ["--max_iters=600"])
    assert given == {"max_iters"}  # given, though equal to its default
    assert cli.given_settings(train.TrainConfig(seed=3)) == {"seed"}  # built in code: what differs


# ------------------------------------------------------------------------------------------ settings: on their fields


def script_settings() -> dict[str, type]:
    """Every script's settings: the class each *.py of the repository passes to parse_flags or parse_given (a
    fork's new script is found too), by "SCRIPT's CLASS"."""
    import importlib
    import re

    found = {}
    for path in sorted(ROOT.glob("*.py")):
        for name in sorted(set(re.findall(r"parse_(?:flags|given)\((\w+)", path.read_text())) - {"cls"}):
            found[f"{path.name}'s {name}"] = getattr(importlib.import_module(path.stem), name)
    return found


def declared_in(cls: type, name: str) -> str:
    """Where field `name` of `cls` is declared, as a fix names it: "GPTConfig in model.py"."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))
    owner = owner.__dict__.get("fields_of", owner)  # cli.unset_fields: train.py's model settings are GPTConfig's
    return f"{owner.__qualname__} in {owner.__module__}.py"


def test_every_setting_of_every_script_declares_its_meaning_on_its_field():
    """Issue 51.2: a setting's meaning is declared once, on its field (metadata "help": one short ASCII line, as
    --help shows it and docs/training.md's table); a field a fork adds without one is named with the fix."""
    import dataclasses

    classes = script_settings()
    assert len(classes) >= 13, classes  # train, finetune, generate, data, eval, analyze, compare, glue, xnli, ...
    for script, cls in classes.items():
        for f in dataclasses.fields(cls):
            meaning = doors.field_meta(cls, f.name).get("help", "")
            assert meaning and meaning.isascii() and meaning.isprintable() and len(meaning) <= 100, (
                f"{script} --{f.name} has no meaning of one short line ({meaning!r}): declare it on its field in "
                f'{declared_in(cls, f.name)}: metadata={{"help": "what it does, one line"}}')


HELP_ROWS = [  # (the settings, a flag, its line in --help from the default on, the meaning under it)
    (train.TrainConfig, "max_iters", "default: 600, in [1, 4294967296]", "optimizer steps"),
    (train.TrainConfig, "lr", "default: 0.001, in (0, 10]", "peak learning rate (AdamW)"),
    (train.TrainConfig, "eps", "default: 1e-08, > 0", "AdamW's epsilon"),
    (train.TrainConfig, "temperature", "default: 1.0, in [0.001, 1000]", "divides the contrastive scores"),
    (train.TrainConfig, "rope_base", "default: None, in [1, 1e+12]", "the rotary angles' base"),
    (train.TrainConfig, "n_layer", "default: None, in [1, 1024]", "transformer blocks"),
    (finetune.FinetuneConfig, "n_layer", "default: None, in [1, 1024]", "transformer blocks"),
    (generate.GenerateConfig, "seed", "default: 1337, in [0, 18446744073709551615]", "the sampling's random seed"),
    (evaluation.EvalConfig, "batch_size", "default: None, in [1, 1048576]", "lambada: examples a pass"),
    (glue.GlueConfig, "dropout", "default: 0.1, in [0, 1)", "dropout in the encoder and before the head"),
]


@pytest.mark.parametrize("cls, name, line, meaning", HELP_ROWS, ids=[f"{c.__name__}-{n}" for c, n, _, _ in HELP_ROWS])
def test_help_shows_a_settings_range_exactly_as_declared_and_its_meaning(cls, name, line, meaning, capsys):
    """Issues 50.4 and 51.2: --help shows each range as declared (an int in all its digits, never 4.29497e+09) and
    the meaning under the flag; the model's settings (cli.unset_fields) keep GPTConfig's meanings."""
    with pytest.raises(SystemExit) as e:
        cli.settings(cls, ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    flag = next(row for row in out.splitlines() if row.startswith(f"  --{name} "))
    assert flag.endswith(line), flag
    assert f"{flag}\n      {meaning}" in out


def test_every_scripts_help_shows_each_settings_meaning_under_it(capsys):
    import dataclasses

    for script, cls in script_settings().items():
        with pytest.raises(SystemExit):
            cli.settings(cls, ["--help"])
        out = capsys.readouterr().out
        for f in dataclasses.fields(cls):
            meaning = doors.field_meta(cls, f.name)["help"]
            assert any(row.startswith(f"  --{f.name} ") and below == f"      {meaning}"
                       for row, below in zip(out.splitlines(), out.splitlines()[1:])), (script, f.name)


REFUSED_SETTINGS = [  # (the settings, the flags, a --config file's text or None, what the one line says)
    (train.TrainConfig, ["--max_iters=4294968000"], None, "--max_iters must be in [1, 4294967296], got 4294968000"),
    (train.TrainConfig, ["--los=ce"], None, "unknown setting --los; did you mean --loss?"),
    (train.TrainConfig, [], "batch_size = 0\n", "config file {config}: batch_size must be in [1, 65536], got 0"),
    (train.TrainConfig, ["--batch_size=70000"], "batch_size = 2\n", "--batch_size must be in [1, 65536], got 70000"),
    (train.TrainConfig, [], 'los = "ce"\n', "config file {config}: unknown setting los; did you mean loss?"),
    (train.TrainConfig, [], 'loss = "mse"\n', "config file {config}: loss='mse' is not valid; choose one of: ce,"),
    (train.TrainConfig, [], "n_layer = 0\n", "config file {config}: n_layer must be in [1, 1024], got 0"),
    (train.TrainConfig, ["--rope_base=0.5"], None, "--rope_base must be in [1, 1e+12], got 0.5"),
    (train.TrainConfig, ["--lr=1e19"], None, "--lr must be in (0, 10], got 1e+19"),
    (compare.CompareConfig, ["--vocab_sizes=-1"], None, "--vocab_sizes must be in [1, 4194304], got -1"),
    (compare.CompareConfig, ["--lr=9.2e18"], None, "--lr must be in (0, 10], got 9.2e+18"),
    (compare.CompareConfig, [], "seeds = [1, -4]\n", "config file {config}: seeds must be in [0, 4294967295], got -4"),
    (compare.CompareConfig, ["--finetune_fraction=0"], None, "--finetune_fraction must be in (0, 1], got 0.0"),
    (evaluation.EvalConfig, ["--max_batches=0"], None, "--max_batches must be in [1, 1099511627776], got 0"),
    (analyze.AnalyzeConfig, ["--tokens=1"], None, "--tokens must be in [2, 1048576], got 1"),
    (glue.GlueConfig, ["--warmup_fraction=1"], None, "--warmup_fraction must be in [0, 1), got 1.0"),
    (xnli.XnliConfig, ["--max_length=1"], None, "--max_length must be in [2, 1048576], got 1"),
    (bench.BenchConfig, ["--vocab_sweep=8192,1"], None, "--vocab_sweep must be in [2, 4194304], got 1"),
    (bpe.MixConfig, ["--vocab_size=100"], None, "--vocab_size must be in [257, 4194304], got 100"),
    (generate.GenerateConfig, ["--seed=-1"], None, "--seed must be in [0, 18446744073709551615], got -1"),
]


@pytest.mark.parametrize("cls, flags, config, words", REFUSED_SETTINGS, ids=[w[:50] for *_, w in REFUSED_SETTINGS])
def test_a_setting_is_refused_by_its_fields_range_naming_it_as_given(cls, flags, config, words, tmp_path):
    """Issue 50.4: every script's ranges are on its fields (the flag's, a --config file's), printed as declared,
    and a refusal names what the user gave: --flag, or the config file and its key."""
    path = tmp_path / "run.toml"
    if config is not None:
        path.write_text(config)
        flags = [f"--config={path}", *flags]
    with pytest.raises(UserError) as e:
        cli.parse_given(cls, flags)
    assert str(e.value).startswith(words.format(config=path)) and "\n" not in str(e.value), str(e.value)


def test_settings_built_in_code_share_the_fields_ranges():
    """Issue 50.4: a script's check refuses a setting built in code by the same declared range as its flag (the
    hand-written checks they replace are gone)."""
    cases = [(compare.check_config, compare.CompareConfig(lr=2.0**63), "--lr must be in (0, 10], got 9.22337"),
             (compare.check_config, compare.CompareConfig(vocab_sizes=[-1]), "--vocab_sizes must be in [1, 4194304]"),
             (glue.check_config, glue.GlueConfig(dropout=1.0), "--dropout must be in [0, 1), got 1.0"),
             (xnli.check_config, xnli.XnliConfig(lr=0.0), "--lr must be in (0, 10], got 0.0"),
             (evaluation.check_config, evaluation.EvalConfig(batch_size=0), "--batch_size must be in [1, 1048576]"),
             (analyze.check_config, analyze.AnalyzeConfig(ckpts=["a"], tokens=1), "--tokens must be in [2, 1048576]"),
             (bench.check_config, bench.BenchConfig(repeats=0), "--repeats must be in [1, 1000000], got 0")]
    for check, cfg, words in cases:
        with pytest.raises(UserError) as e:
            check(cfg)
        assert words in str(e.value)
    assert not hasattr(common, "bounded")


@given(st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False)))
def test_a_bound_is_shown_exactly(value):
    """Issue 50.4: a declared bound reads back as itself (:g printed 4294968000's bound 2^32 as 4.29497e+09)."""
    shown = doors.shown_number(value)
    assert (int(shown) if isinstance(value, int) else float(shown)) == value


def test_docs_training_table_is_the_fields_declarations():
    """Issue 51.2: docs/training.md's table of train.py's settings is cli.settings_table(TrainConfig): each row
    the flag's default, range and meaning as declared on its field; a row that differs is named with its fix."""
    import itertools

    doc = (ROOT / "docs" / "training.md").read_text()
    start = "<!-- settings table: cli.settings_table(train.TrainConfig) -->\n"
    assert start in doc
    rows = doc.split(start, 1)[1].split("\n<!-- end of settings table -->", 1)[0].splitlines()
    want = cli.settings_table(train.TrainConfig).splitlines()
    for number, (row, line) in enumerate(itertools.zip_longest(rows, want), 1):
        assert row == line, (f"docs/training.md's settings table, row {number}, reads {row!r}; the fields say {line!r} "
                             "(the whole table: python -c 'import doors, train; "
                             "print(cli.settings_table(train.TrainConfig))')")

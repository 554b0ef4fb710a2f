"""convert.py (issue 50): the command a ckpt.pt's refusal prints is safe to paste (quoted, full paths, from any
folder), converts it into a checkpoint every door takes, and never replaces a file; its own refusals are one line.
A .safetensors of an earlier layout is refused by every door naming it too, and converted the same way (issue 54)."""
from __future__ import annotations

import copy
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import read_ckpt, refusal, save_ckpt, tiny_config

import checkpoint
import convert
import doors
import generate
import model
import train
from common import UserError

HOSTILE = "my run's \"best\" $(touch PWNED) `touch PWNED`"  # a space, both quotes, two command substitutions


@pytest.fixture(scope="module")
def old_checkpoint(tiny_data_dir, tmp_path_factory) -> Path:
    """A checkpoint as train.py writes it, saved the old way (torch.save) as ckpt.pt in a folder of a hostile name."""
    root = tmp_path_factory.mktemp("old")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=1, n_head=2, d_model=32, block_size=16))
        train.train(tiny_config(tiny_data_dir, root / "run", block_size=16, batch_size=2, max_iters=1,
                                eval_interval=1, eval_batches=1))
    folder = root / HOSTILE
    folder.mkdir()
    torch.save(read_ckpt(root / "run" / "ckpt.safetensors"), folder / "ckpt.pt")
    return folder / "ckpt.pt"


def test_the_printed_command_converts_from_any_folder_runs_nothing_else_and_never_replaces(old_checkpoint,
                                                                                           tmp_path):
    with pytest.raises(UserError) as e:
        generate.main([f"--ckpt={old_checkpoint}", "--prompt=a", "--device=cpu"])
    assert "\n" not in str(e.value)
    command = str(e.value).split("a file you trust as your own: ", 1)[1]
    elsewhere = tmp_path / "elsewhere"  # neither the repository nor the checkpoint's folder
    elsewhere.mkdir()
    pasted = subprocess.run(["bash", "-c", command], cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    new = old_checkpoint.with_suffix(".safetensors")
    ckpt = checkpoint.read_checkpoint(new, train.TrainConfig)
    old = torch.load(old_checkpoint, weights_only=True)
    assert doors.plain(ckpt.state) == old["state"] and ckpt.train_config == old["train_config"]
    assert all(torch.equal(ckpt.model[k], t) for k, t in old["model"].items())
    before = new.read_bytes()
    again = subprocess.run(["bash", "-c", command], cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --out={new} exists; it is never replaced: move it away or pass another --out"]
    assert new.read_bytes() == before
    roots = (tmp_path, old_checkpoint.parents[1], Path(convert.__file__).parent)
    assert not [p for root in roots for p in root.rglob("PWNED")]
    assert sorted(p.name for p in old_checkpoint.parent.iterdir()) == ["ckpt.pt", "ckpt.safetensors"]


@pytest.mark.parametrize("case, make, words", [
    ("not a zip", lambda p: p.write_bytes(b"not a pickle at all"), "is neither a torch.save file (a zip) nor"),
    ("a folder", lambda p: p.mkdir(), "is a folder"),
    ("missing", lambda p: None, "not found"),
    ("a zip of something else", lambda p: torch.save([1, 2], p), "holds a list, not a checkpoint's table"),
    ("a checkpoint without weights", lambda p: torch.save({"step": 1}, p), "is not a headless-lm checkpoint"),
    # issue 55 point 4: what torch's safe loader refused, in the project's words (never its advice to load unsafely)
    ("a pickle that would run code", lambda p: torch.save({"model": {}, "x": RunsCode()}, p),
     "holds Python objects that torch's safe loader refuses to build (it would call posix.system); this project "
     "converts only its own checkpoints"),
    ("a zip bomb", lambda p: zip_bomb(p), "holds compressed parts (ckpt/data/0), which torch.save never writes"),
    ("an empty model", lambda p: torch.save({"model": {}, "model_config": {"block_size": 16}}, p), "no model weights"),
    ("weights without their config", lambda p: torch.save({"model": {"w": torch.zeros(2)}}, p),
     "holds model weights but no model_config (the model's shape)"),
    ("--out below a file", lambda p: (torch.save({"model": {"w": torch.zeros(2)}}, p), (p.parent / "f").touch()),
     "--out={tmp}/f/ckpt.safetensors: a folder above it is a file; pass --out in a folder"),
    ("today's layout", lambda p: save_ckpt({"model": {"w": torch.zeros(2)}, "model_config": {}}, p),
     "is a checkpoint of today's layout: it needs no conversion"),
])
def test_a_bad_old_file_is_refused_in_one_line_and_nothing_is_written(case, make, words, tmp_path, monkeypatch,
                                                                      capsys):
    old = tmp_path / "ckpt.pt"
    make(old)
    out = tmp_path / ("f" if case == "--out below a file" else ".") / "ckpt.safetensors"
    before = sorted(p.name for p in tmp_path.iterdir())
    written = []  # refused before anything is written (a 1 GiB checkpoint's temp file, say)
    monkeypatch.setattr(convert, "save_checkpoint", lambda *a: written.append(a))
    line = refusal(convert.main, [f"--ckpt={old}", f"--out={out}"], monkeypatch, capsys)
    assert words.format(tmp=tmp_path) in line and "weights_only" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not written
    assert not (Path.cwd() / "PWNED").exists()


class RunsCode:
    """A pickle that would run a command when loaded unsafely (torch's safe loader refuses it)."""
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def zip_bomb(path: Path) -> None:
    """A torch.save file whose tensor's bytes are stored compressed: 1 MiB of zeros in 1 kB, inflated by a reader."""
    torch.save({"model": {"w": torch.zeros(1 << 18)}}, path)
    with zipfile.ZipFile(path) as z:
        parts = {info.filename: z.read(info) for info in z.infolist()}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in parts.items():
            z.writestr(name, data, zipfile.ZIP_DEFLATED if name.endswith("data/0") else zipfile.ZIP_STORED)


EARLIER = {  # an earlier layout made from today's checkpoint, and the state its conversion holds, from today's
    "counts beside state, a disabled scaler's {}": (
        lambda c: {**c, "step": 1, "loss": 9.0, "tokens_seen": 5, "scaler": {}}, lambda state: state),
    "counts, no state": (
        lambda c: {**{k: v for k, v in c.items() if k != "state"}, "step": 4, "loss": 3.5, "val": {"val_ce": 3.0},
                   "first_val": {"val_ce": 4.0}, "tokens_seen": 128, "flops": 1.0e6, "base_tokens": 64,
                   "base_flops": 2.0},
        lambda state: dict(step=4, micro_batches=None, tokens=128, flops=1.0e6, earlier_tokens=64, earlier_flops=2.0,
                           loss=3.5, first_val={"val_ce": 4.0}, val={"val_ce": 3.0}, val_step=4)),
    "an import's source, a state before val_step": (
        lambda c: {**c, "source": "hf:x", "state": {k: v for k, v in c["state"].items() if k != "val_step"}},
        lambda state: {**state, "val_step": None}),  # the step validated at is not known
}


@pytest.mark.parametrize("layout", list(EARLIER))
def test_an_earlier_layouts_refusal_prints_the_command_that_converts_it(layout, old_checkpoint, tmp_path,
                                                                        monkeypatch, capsys):
    """What earlier readers made of an older file (the removed checkpoint.upgraded), convert.py makes once: counts kept
    beside the state dropped, or made its state (which cannot resume exactly: no data position); val_step the
    step validated at where known; an import's source dropped; a disabled scaler none."""
    today = read_ckpt(old_checkpoint.parents[1] / "run" / "ckpt.safetensors")
    make, state = EARLIER[layout]
    path = tmp_path / "ckpt.safetensors"
    save_ckpt(make(copy.deepcopy(today)), path)
    line = refusal(generate.main, [f"--ckpt={path}", "--prompt=a", "--device=cpu"], monkeypatch, capsys)
    command = line.split("convert it once: ", 1)[1]
    pasted = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    ckpt = checkpoint.read_checkpoint(tmp_path / "ckpt-converted.safetensors", train.TrainConfig)
    assert doors.plain(ckpt.state) == state(today["state"]) and ckpt.scaler is None
    assert all(torch.equal(ckpt.model[k], t) for k, t in today["model"].items())

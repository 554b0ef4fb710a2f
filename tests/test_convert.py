"""convert.py (issue 50): the command a ckpt.pt's refusal prints is safe to paste (quoted, full paths, from any
folder), converts it into a checkpoint every door takes, and never replaces a file; its own refusals are one line."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_ckpt, refusal, tiny_config

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
    ("not a zip", lambda p: p.write_bytes(b"not a pickle at all"), "is not a torch.save file (a zip)"),
    ("a folder", lambda p: p.mkdir(), "is a folder"),
    ("missing", lambda p: None, "not found"),
    ("a zip of something else", lambda p: torch.save([1, 2], p), "holds a list, not a checkpoint's table"),
    ("a checkpoint without weights", lambda p: torch.save({"step": 1}, p), "is not a headless-lm checkpoint"),
])
def test_a_bad_old_file_is_refused_in_one_line_and_nothing_is_written(case, make, words, tmp_path, monkeypatch,
                                                                      capsys):
    old = tmp_path / "ckpt.pt"
    make(old)
    line = refusal(convert.main, [f"--ckpt={old}", f"--out={tmp_path / 'ckpt.safetensors'}"], monkeypatch, capsys)
    assert words in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if case == "missing" else ["ckpt.pt"])

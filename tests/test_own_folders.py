"""Issue 50: a command writes nothing outside the folders it is given, its libraries' caches, logs and temp files
included (the datasets library's, tiktoken's, tokenizers', matplotlib's, torch's, W&B's and TensorBoard's). Every
command runs, with tiny settings, in a process of its own whose HOME, XDG_*_HOME, TMPDIR and current folder are
empty folders; they stay empty."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import analyze  # noqa: F401 (the commands run below: a fork without one drops this test with it)
import corpora  # noqa: F401
import eval  # noqa: F401
import results  # noqa: F401
import tracking  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
ELSEWHERE = ("home", "config", "cache", "data", "state", "runtime", "tmp", "cwd")  # must stay empty
COMMANDS = """
import os, sys
sys.path.insert(0, ROOT)
import common, prepare, train, finetune, generate, eval, results, analyze, model
model.PRESETS["tiny"] = dict(n_layer=1, n_head=2, d_model=32, block_size=16)


def run(script, argv):
    # `python SCRIPT.py ARGV` in a process of its own, forked from this one, which only imported: what a command
    # imports or leaves in its process (torch's compiler, once trained) cannot hide what the next one writes. The
    # child ends as a command does, its exit handlers run (W&B removes its temp folders there)
    pid = os.fork()
    if pid == 0:
        sys.argv = [script.__name__ + ".py", *argv]
        common.run_main(script.main)
        sys.exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        sys.exit(f"{script.__name__}.py {argv} failed")


corpus, d, out, ft = (f"{WORK}/{name}" for name in ("corpus", "data", "out", "ft"))
tiny = ["--block_size=16", "--batch_size=2", "--eval_batches=1", "--warmup_iters=1", "--device=cpu"]
run(prepare, [f"--dataset={corpus}", f"--data_root={d}", "--val_fraction=0.5"])  # GPT-2's tokens (tiktoken)
run(prepare, [f"--dataset={corpus}", f"--data_root={d}", "--val_fraction=0.5", "--tokenizer=bpe:260"])  # tokenizers'
run(train, [f"--dataset={d}/corpus-bpe260", f"--out_dir={out}", "--preset=tiny", "--max_iters=2", "--eval_interval=2",
            "--tensorboard", "--wandb", *tiny])
run(finetune, [f"--ckpt={out}/ckpt.safetensors", f"--out_dir={ft}", "--max_iters=1", f"--data_root={d}"])
run(generate, [f"--ckpt={ft}/ckpt.safetensors", "--prompt=To be", "--max_new_tokens=2", "--device=cpu"])
run(eval, [f"--ckpt={out}/ckpt.safetensors", "--task=val", f"--data_root={d}", "--max_batches=1", "--device=cpu"])
run(results, [f"--log={out}/log.jsonl,{ft}/log.jsonl", f"--plot={WORK}/curves.png"])
run(analyze, [f"--ckpts={out}/ckpt.safetensors", f"--data_root={d}", "--tokens=16", "--device=cpu",
              f"--plot={WORK}/analyze.png"])
"""
LEFT_OUT = ("WANDB_", "MPLCONFIGDIR", "HF_HOME", "HF_DATASETS_CACHE", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR",
            "TORCHINDUCTOR_CACHE_DIR", "XDG_")  # where a user would have told the libraries to write


def test_every_command_writes_only_under_the_folders_it_is_given(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    folders = {name: tmp_path / name for name in ELSEWHERE}
    for folder in folders.values():
        folder.mkdir()
    work = tmp_path / "given"
    (work / "corpus").mkdir(parents=True)
    (work / "corpus" / "play.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    env = {name: value for name, value in os.environ.items() if not name.startswith(LEFT_OUT)}
    env.update(HOME=str(folders["home"]), XDG_CONFIG_HOME=str(folders["config"]),
               XDG_CACHE_HOME=str(folders["cache"]), XDG_DATA_HOME=str(folders["data"]),
               XDG_STATE_HOME=str(folders["state"]), XDG_RUNTIME_DIR=str(folders["runtime"]),
               TMPDIR=str(folders["tmp"]), WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_ERROR_REPORTING="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    script = f"ROOT, WORK = {str(ROOT)!r}, {str(work)!r}\n{COMMANDS}"
    done = subprocess.run([sys.executable, "-c", script], cwd=folders["cwd"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    written = {name: sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) for name, folder in folders.items()}
    assert written == {name: [] for name in ELSEWHERE}
    assert list((work / "out" / "wandb" / "cache").rglob("core-debug-*.log"))  # W&B's own log: in its run's folder
    datasets = sorted(p.name for p in (work / "data").iterdir())
    assert datasets == [".corpus-bpe260.lock", ".corpus.lock", "corpus", "corpus-bpe260"]  # no cache left

"""What a fork relies on: every GPTConfig field is a flag (one a fork adds too), by one rule from the preset or the
checkpoint; the objective's settings travel as one loss.LossConfig, and a piece of the objective that learns is
trained, saved, restored and scored with no code beyond declaring it; a fine-tune reads on in its pre-training's
data stream; the scored count of an encoder is one function's; the random streams of micro-batches never meet."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_error_line, read_ckpt, read_log, snapshot, tiny_config
from hypothesis import given, settings, strategies as st

import checkpoint
import checkpoint_format
import cli
import data
import finetune
import model as model_module
import plan
import train
from common import UserError
from loss import LossConfig
from model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def saved(out_dir: Path) -> dict:
    return read_ckpt(Path(out_dir) / "ckpt.safetensors")


# ------------------------------------------------------------------------------------------ the model's settings


def test_every_gptconfig_field_but_the_derived_ones_is_a_flag_of_train_finetune_and_compare():
    import compare

    fields = {f.name for f in dataclasses.fields(GPTConfig)} - set(plan.DERIVED)
    for config in (train.TrainConfig, finetune.FinetuneConfig, compare.CompareConfig):
        assert fields <= {f.name for f in dataclasses.fields(config)}, config
    assert set(plan.DERIVED) & {f.name for f in dataclasses.fields(train.TrainConfig)} == set()
    cfg = cli.parse_flags(train.TrainConfig, ["--n_layer=3", "--norm=rmsnorm", "--mlp_hidden=344", "--bias=false"])
    assert (cfg.n_layer, cfg.norm, cfg.mlp_hidden, cfg.bias) == (3, "rmsnorm", 344, False)


def test_a_fresh_run_takes_each_model_flag_else_the_presets_value(tiny_data_dir, tmp_path):
    train.train(tiny_config(tiny_data_dir, tmp_path, max_iters=1, eval_interval=1, n_layer=3, norm="rmsnorm",
                            mlp_hidden=40, parallel_residual=False, dropout=0.1))
    ckpt = saved(tmp_path)
    model_config = ckpt["model_config"]
    assert (model_config["n_layer"], model_config["norm"], model_config["mlp_hidden"]) == (3, "rmsnorm", 40)
    assert model_config["parallel_residual"] is False and model_config["dropout"] == 0.1
    assert (model_config["d_model"], model_config["n_head"]) == (64, 2)  # the (shrunk) preset's
    assert model_config["block_size"] == 32 == ckpt["train_config"]["block_size"]  # the flag: one setting
    assert ckpt["model"]["blocks.0.mlp.up.weight"].shape == (40, 64)
    assert ckpt["train_config"]["n_layer"] == 3 and ckpt["train_config"]["d_model"] == 64  # recorded as it ran


@pytest.fixture(scope="module")
def base_run(tiny_data_dir, tmp_path_factory):
    """A 2-step CWT run with dropout 0.1 and block 32."""
    out = tmp_path_factory.mktemp("base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(__import__("model").PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        train.train(tiny_config(tiny_data_dir, out, max_iters=2, eval_interval=2, dropout=0.1))
    return out


@pytest.mark.parametrize("flag, value, message", [
    ("n_layer", 3, "--n_layer=3 but {ckpt} holds a model with n_layer=2"),
    ("norm", "rmsnorm", "--norm=rmsnorm but {ckpt} holds a model with norm=layernorm"),
    ("block_size", 33, "--block_size=33 but {ckpt} holds a model with block_size=32"),
])
def test_a_run_from_a_checkpoint_refuses_a_model_flag_that_contradicts_it(base_run, tiny_data_dir, tmp_path, flag,
                                                                           value, message):
    ckpt = base_run / "ckpt.safetensors"
    runs = [(train.train, tiny_config(tiny_data_dir, tmp_path / "a", init_from=str(ckpt), **{flag: value}))]
    if flag != "block_size":  # finetune.py refuses a longer block before it looks at any data, in its own words
        runs.append((finetune.finetune, finetune.FinetuneConfig(ckpt=str(ckpt), out_dir=str(tmp_path / "b"),
                                                                device="cpu", max_iters=1, **{flag: value},
                                                                data_root=str(tiny_data_dir.parent))))
    for runner, cfg in runs:
        with pytest.raises(UserError) as e:
            runner(cfg)
        assert message.format(ckpt=ckpt) in str(e.value) and "\n" not in str(e.value)


def test_a_run_from_a_checkpoint_keeps_its_model_and_may_change_dropout_and_shorten_the_block(base_run, tiny_data_dir,
                                                                                              tmp_path):
    ckpt = base_run / "ckpt.safetensors"
    train.train(tiny_config(tiny_data_dir, tmp_path / "same", init_from=str(ckpt), max_iters=1, eval_interval=1,
                            n_layer=2, block_size=None))
    same = saved(tmp_path / "same")
    assert same["model_config"]["dropout"] == 0.1 and same["train_config"]["block_size"] == 32  # the checkpoint's
    train.train(tiny_config(tiny_data_dir, tmp_path / "changed", init_from=str(ckpt), max_iters=1, eval_interval=1,
                            dropout=0.0, block_size=16))
    changed = saved(tmp_path / "changed")
    assert changed["model_config"]["dropout"] == 0.0 and changed["train_config"]["block_size"] == 16
    assert changed["model_config"]["block_size"] == 32  # the model's context stays; the windows are shorter


def test_resume_takes_the_checkpoints_model_and_window(base_run, tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    summary = train.train(tiny_config(tiny_data_dir, out, max_iters=3, resume=True, block_size=None, dropout=None))
    ckpt = saved(out)
    assert summary["step"] == 3 and ckpt["train_config"]["block_size"] == 32 and ckpt["model_config"]["dropout"] == 0.1


@pytest.mark.parametrize("flags, message", [
    (["--n_head=3"], "d_model 64 is not a multiple of n_head 3"),
    (["--rotary_pct=2"], "--rotary_pct must be in [0, 1], got 2.0"),
    (["--n_layer=0"], "--n_layer must be in [1, 1024], got 0"),
    (["--norm=batchnorm"], "--norm='batchnorm' is not valid; choose one of: layernorm, rmsnorm"),
    (["--d_model=96", "--n_head=4", "--rotary_pct=0.25"], None),  # fits: 24-channel heads, 6 rotated
])
def test_model_flags_are_checked_by_the_checkpoint_doors_rules_before_any_work(tiny_data_dir, tmp_path, flags,
                                                                               message):
    argv = [f"--dataset={tiny_data_dir}", "--preset=tiny", "--block_size=16", "--batch_size=2", "--max_iters=1",
            "--eval_interval=1", "--eval_batches=1", "--device=cpu", f"--out_dir={tmp_path / 'o'}", *flags]
    if message is None:
        train.main(argv)
        assert saved(tmp_path / "o")["model_config"]["d_model"] == 96
        return
    with pytest.raises(UserError) as e:
        train.main(argv)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert snapshot(tmp_path / "o") == {}  # nothing but the released lock


def test_help_lists_the_models_fields_as_their_own_group():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    groups = re.split(r"\n\n(?=\S)", result.stdout)
    model = next(g for g in groups if g.startswith("model settings"))
    objective = next(g for g in groups if g.startswith("objective settings"))
    flags = {group: re.findall(r"^  --(\w+)", text, re.M) for group, text in (("model", model),
                                                                                ("objective", objective))}
    assert flags["model"] == list(plan.MODEL_FIELDS)
    assert flags["objective"] == [f.name for f in dataclasses.fields(LossConfig)]


def test_a_field_a_fork_adds_to_gptconfig_is_a_flag_recorded_and_checked_with_no_edit_elsewhere(tiny_data_dir,
                                                                                                 tmp_path):
    """The fork's change: one line in model.py. Then --mlp=swiglu is a flag, recorded in model_config, checked
    by its Literal, and a run from the checkpoint refuses another value."""
    fork = tmp_path / "fork"
    shutil.copytree(ROOT, fork, ignore=shutil.ignore_patterns(".git", "data", "out*", "__pycache__", ".*cache"))
    model_py = fork / "model.py"
    source = model_py.read_text()
    line = '    causal: bool = field(default=True, '
    assert line in source
    model_py.write_text(source.replace(line, '    mlp: Literal["gelu", "swiglu"] = "gelu"\n' + line, 1))
    flags = ["--preset=tiny", "--n_layer=1", "--block_size=16", "--batch_size=2", "--max_iters=1", "--eval_interval=1",
             "--eval_batches=1", "--device=cpu", f"--dataset={tiny_data_dir}"]
    trained, bad, other = run_fork(fork, flags, [["--mlp=swiglu", "--out_dir=a"], ["--mlp=relu", "--out_dir=b"],
                                                 ["--mlp=gelu", "--init_from=a/ckpt.safetensors", "--out_dir=c"]])
    saved = checkpoint_format.checkpoint_file(fork / "a" / "ckpt.safetensors")
    assert trained[0] == 0 and saved["model_config"]["mlp"] == "swiglu"
    assert bad[0] == 2 and "--mlp='relu' is not valid; choose one of: gelu, swiglu" in bad[2]
    assert other[0] == 2 and "--mlp=gelu but a/ckpt.safetensors holds a model with mlp=swiglu" in other[2]


def test_a_bounded_setting_a_fork_adds_to_trainconfig_needs_that_one_line(tiny_data_dir, tmp_path):
    """Issue 39's done-when: one line in train.py (a bounded int field) gives the flag, --help with its range, the
    range check of the flag and of a --config file, the saved value, the check of a checkpoint's value and the
    --resume rule (the run's own unless given)."""
    fork = tmp_path / "fork"
    shutil.copytree(ROOT, fork, ignore=shutil.ignore_patterns(".git", "data", "out*", "__pycache__", ".*cache"))
    train_py = fork / "train.py"
    line = '    log_interval: int = field(default=10, '
    assert train_py.read_text().count(line) == 1
    probe = '    probe_every: int = field(default=3, metadata={"range": (1, 8), "help": "steps between probes"})\n'
    train_py.write_text(train_py.read_text().replace(line, probe + line))
    (fork / "c.toml").write_text("probe_every = 0\n")
    flags = ["--preset=tiny", "--n_layer=1", "--block_size=16", "--batch_size=2", "--eval_interval=1",
             "--eval_batches=1", "--device=cpu", f"--dataset={tiny_data_dir}"]
    steps = [["--help"], ["--probe_every=9", "--out_dir=b"], ["--config=c.toml", "--out_dir=b"],
             ["--probe_every=5", "--max_iters=1", "--out_dir=a"], ["--resume", "--max_iters=2", "--out_dir=a"],
             ["set", "a", 99], ["--resume", "--max_iters=3", "--out_dir=a"]]
    helped, too_big, config_file, trained, resumed, saved, refused = run_fork(fork, flags, steps)
    assert "--probe_every" in helped[1] and "default: 3, in [1, 8]\n      steps between probes" in helped[1]
    assert too_big[0] == 2 and "--probe_every must be in [1, 8], got 9" in too_big[2]
    assert config_file[0] == 2 and "config file c.toml: probe_every must be in [1, 8], got 0" in config_file[2]
    assert not (fork / "b").exists()
    assert trained[0] == 0 and trained[3] == 5
    assert resumed[0] == 0 and resumed[3] == 5  # not given: the run's own 5, not the default 3
    assert saved == ["set", "a", 99]
    assert refused[0] == 2 and "train_config.probe_every is 99, outside [1, 8]" in refused[2]


def run_fork(fork: Path, flags: list[str], steps: list, read: tuple[str, str] = ("train_config", "probe_every")
             ) -> list:
    """Each step in one process of the fork (FORK_DRIVER): one start-up of torch, not one a command. After each,
    the value at `read` (a table of the checkpoint and a key in it) in out_dirs a and b."""
    done = subprocess.run([sys.executable, "-c", FORK_DRIVER, json.dumps(flags), json.dumps(steps), json.dumps(read)],
                          cwd=fork, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


# One process runs each step of a fork's commands as `python train.py ARGV` would (run_main: exit code, stdout,
# stderr), and reads a value of the checkpoints in a and b after each (["set", OUT, VALUE] writes VALUE there, with
# the project's own writer: a valid checksum)
FORK_DRIVER = """
import contextlib, io, json, sys
sys.path.insert(0, "tests")
import checkpoint_format, common, doors, train
from helpers import save_ckpt
flags, steps, (table, key) = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
def saved(out):
    with contextlib.suppress(Exception):
        return checkpoint_format.checkpoint_file(out + "/ckpt.safetensors")[table].get(key)
said = []
for argv in steps:
    if argv[0] == "set":
        ckpt = checkpoint_format.checkpoint_file(argv[1] + "/ckpt.safetensors")
        ckpt[table][key] = argv[2]
        save_ckpt(ckpt, argv[1] + "/ckpt.safetensors")
        said.append(argv)
        continue
    sys.argv = ["train.py", *(argv if argv == ["--help"] else [*flags, *argv])]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            common.run_main(train.main)
            code = 0
        except SystemExit as e:
            code = e.code
    said.append([code, out.getvalue(), err.getvalue(), saved("a"), saved("b")])
print(json.dumps(said))
"""


# ------------------------------------------------------------------------------------------ docs/hacking.md's recipes

# Each recipe of new run state, by its heading in docs/hacking.md: the value a hostile hand writes in its checkpoint
# (a table path and a value, or {"shape": ...}: a tensor of that shape), what the one line then says, and the readers
# that must refuse it too besides --resume
RECIPES = {
    "A number updated at logging": dict(recipe="loss_max", hostile=(["state", "loss_max"], -1.0),
                                        refused="state.loss_max is -1.0, outside [0, "),
    "A value updated every step": dict(recipe="loss_ema", hostile=(["state", "loss_ema"], math.nan),
                                       refused="state.loss_ema is nan, not a finite number"),
    "A tensor the size of the weights": dict(
        recipe="ema", hostile=(["ema", "wte.weight"], {"shape": [3]}),
        refused="does not match this model code: tensor wte.weight has shape [3] in the weights",
        readers=[["generate.py", "--ckpt={ckpt}", "--prompt=a", "--device=cpu"]]),
    "A learned piece of the objective": dict(
        recipe="temperature", hostile=(["objective", "log_temperature"], {"shape": [3]}),
        refused="its objective holds 'log_temperature [3] float32', not the 'log_temperature [] float32' this "
                "run's objective declares; resume with the code that wrote it"),
}
RECIPE_FLAGS = ["--preset=tiny", "--n_layer=1", "--n_head=2", "--d_model=64", "--block_size=32", "--batch_size=8",
                "--max_iters=6", "--eval_interval=3", "--eval_batches=1", "--log_interval=1", "--device=cpu"]


def recipe_diff(heading: str) -> str:
    """The diff under `### heading` in docs/hacking.md: its one ```diff block."""
    text = (ROOT / "docs" / "hacking.md").read_text()
    section = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^##)", text + "\n##", re.M | re.S)
    assert section, f"docs/hacking.md has no section '### {heading}'"
    blocks = re.findall(r"^```diff\n(.*?)^```$", section.group(1), re.M | re.S)
    assert len(blocks) == 1, f"docs/hacking.md's '### {heading}' holds {len(blocks)} ```diff blocks, not one"
    return blocks[0]


def applied(diff: str, fork: Path, heading: str) -> None:
    """The diff applied to the copy as `git apply` does it (its context lines checked): a failure names the recipe."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(fork.parent)}  # no repository around the copy is used
    done = subprocess.run(["git", "apply", "-v", "-"], input=diff, cwd=fork, capture_output=True, text=True, env=env,
                          timeout=60)
    if done.returncode != 0:
        pytest.fail(f"docs/hacking.md's recipe '{heading}' no longer applies to this code; update its diff to the "
                    f"code it edits:\n{done.stderr}")


@pytest.mark.parametrize("heading", RECIPES)
def test_each_recipe_of_hacking_md_trains_stops_resumes_exactly_and_refuses_a_hostile_value(tiny_data_dir, tmp_path,
                                                                                             heading):
    """Issue 54.3: each recipe's diff applied to a copy of the repository, then as a user runs it: a tiny run
    straight; the same run stopped at step 4 (--stop_at) and resumed with --resume alone, equal to the straight one
    (every log record but its timing, every tensor of the checkpoint: weights, optimizer, the recipe's own, and every
    State field); then its new value made hostile in the checkpoint, refused in one line by --resume and every
    reader named, with nothing written."""
    spec = RECIPES[heading]
    fork = tmp_path / "fork"
    shutil.copytree(ROOT, fork, ignore=shutil.ignore_patterns(".git", "data", "out*", "__pycache__", ".*cache"))
    applied(recipe_diff(heading), fork, heading)
    request = {"recipe": spec["recipe"], "flags": [*RECIPE_FLAGS, f"--dataset={tiny_data_dir}"], "stop_at": 4,
               "hostile": spec["hostile"], "readers": spec.get("readers", []), "data_root": str(tiny_data_dir.parent)}
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "CUDA_VISIBLE_DEVICES": ""}  # --resume alone: the CPU
    done = subprocess.run([sys.executable, "tests/recipe_run.py", json.dumps(request)], cwd=fork, capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["straight"][0] == 0 and result["resumed"][0] == 0, (result["straight"], result["resumed"])
    assert result["stopped"][0] == 0 and "stopped at step 4" in result["stopped"][1], result["stopped"]
    straight, resumed = result["logs"]
    assert len([r for r in straight if "loss" in r]) == 6 and resumed == straight
    assert result["states"][0] == result["states"][1] and result["differ"] == []
    assert any(name.startswith("/optimizer/state/") for name in result["tensors"])
    for code, err in result["refused"]:
        assert code == 2 and spec["refused"] in one_error_line(err), err[-2000:]
    assert result["untouched"]
    checks_of_the_recipe(spec["recipe"], result, straight)


def checks_of_the_recipe(recipe: str, result: dict, log: list[dict]) -> None:
    """What each recipe's value is: the largest logged loss; the moving average of every step's loss; the weights'
    average, which every reader loads; a temperature that trained, with which eval.py scores as the run did."""
    state = result["states"][0]
    losses = [r["loss"] for r in log if "loss" in r]
    if recipe == "loss_max":
        assert state["loss_max"] == max(losses)
    if recipe == "loss_ema":
        average = losses[0]
        for loss in losses[1:]:
            average = 0.9 * average + 0.1 * loss
        assert state["loss_ema"] == pytest.approx(average, rel=1e-12)
    if recipe == "ema":
        assert "/ema/wte.weight" in result["tensors"] and result["extra"]["ema_is_not_the_weights"]
        assert result["extra"]["readers_get_the_ema"] and result["extra"]["generate"][0] == 0
    if recipe == "temperature":
        assert "/objective/log_temperature" in result["tensors"] and result["extra"]["log_temperature"] != 0.0
        assert result["extra"]["val_cwt"] == pytest.approx([r for r in log if "val_cwt" in r][-1]["val_cwt"], rel=1e-6)


# ------------------------------------------------------------------------------------------ the optimizer

# A fork's optimizer, built where train.py builds AdamW (model.adamw's one line): its state_dict holds other names
# (RMSprop: square_avg, momentum_buffer, grad_avg; SGD: momentum_buffer and no step), which the doors never name
FORKED_OPTIMIZERS = {
    "RMSprop": lambda groups, lr: torch.optim.RMSprop(groups, lr=lr, momentum=0.9, centered=True),
    "SGD momentum": lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", FORKED_OPTIMIZERS)
def test_a_forked_optimizer_trains_saves_and_resumes_exactly_with_no_edit_to_the_doors(tiny_data_dir, tmp_path,
                                                                                        monkeypatch, name):
    """Issue 40: the optimizer's state is checked for what any torch optimizer keeps, so swapping AdamW in the one
    place it is built resumes bit-exact (losses, lrs, weights, every state tensor); a checkpoint of it given to
    the unforked code (AdamW) is refused in one line before anything is loaded."""
    def forked(module, lr, weight_decay, betas, eps=1e-8):
        params = [p for p in module.parameters() if p.requires_grad]
        return FORKED_OPTIMIZERS[name]([{"params": [p for p in params if p.dim() >= 2]},
                                        {"params": [p for p in params if p.dim() < 2]}], lr)

    monkeypatch.setattr(train, "adamw", forked)
    run = dict(max_iters=6, warmup_iters=2, eval_interval=3, lr_schedule="cosine")
    train.train(tiny_config(tiny_data_dir, tmp_path / "straight", **run))
    train.train(tiny_config(tiny_data_dir, tmp_path / "resumed", **{**run, "max_iters": 3}))
    train.train(tiny_config(tiny_data_dir, tmp_path / "resumed", max_iters=6, warmup_iters=None, resume=True))

    def steps(d):
        return {r["step"]: (r["loss"], r["lr"]) for r in read_log(d) if "loss" in r}
    assert len(steps(tmp_path / "straight")) == 6 and steps(tmp_path / "resumed") == steps(tmp_path / "straight")
    straight, resumed = saved(tmp_path / "straight"), saved(tmp_path / "resumed")
    assert all(torch.equal(resumed["model"][k], t) for k, t in straight["model"].items())
    state, other = straight["optimizer"]["state"], resumed["optimizer"]["state"]
    assert state.keys() == other.keys() and len(state) > 0
    for pid, entry in state.items():
        assert entry.keys() == other[pid].keys() and "exp_avg" not in entry
        assert all(torch.equal(t, other[pid][k]) if isinstance(t, torch.Tensor) else t == other[pid][k]
                   for k, t in entry.items())
    assert "momentum_buffer" in state[0]
    monkeypatch.setattr(train, "adamw", model_module.adamw)  # the unforked code: AdamW, which cannot take this state
    with pytest.raises(UserError) as e:
        train.train(tiny_config(tiny_data_dir, tmp_path / "resumed", max_iters=8, warmup_iters=None, resume=True))
    assert "the state of another optimizer" in str(e.value) and "\n" not in str(e.value)
    assert steps(tmp_path / "resumed") == steps(tmp_path / "straight")  # nothing was run or written


# ------------------------------------------------------------------------------------------ the objective


def test_loss_settings_travel_as_one_dataclass_and_older_checkpoints_get_its_defaults():
    cfg = train.TrainConfig(loss="nce", temperature=0.5, num_negatives=7, loss_chunk_size=16)
    config = LossConfig.of(cfg)
    assert type(config) is LossConfig and config == LossConfig(loss="nce", temperature=0.5, negatives="all",
                                                               num_negatives=7, negatives_scope="local",
                                                               loss_chunk_size=16)
    assert LossConfig.of({"loss": "ce", "some_old_key": 1}) == LossConfig(loss="ce")  # earlier checkpoints' keys
    assert train.Objective(None, config).settings() is config
    same = plan.same_settings(train.TrainConfig)
    assert {"loss", "temperature", "negatives", "num_negatives", "negatives_scope"} <= set(same)
    assert "loss_chunk_size" not in same  # the same loss, other memory: may change on resume


@pytest.mark.parametrize("flags", [dict(num_negatives=4), dict(negatives="unique"), dict(temperature=0.5),
                                   dict(negatives_scope="global")])
def test_loss_flags_that_change_nothing_under_ce_are_refused(tiny_data_dir, tmp_path, flags):
    with pytest.raises(UserError, match="cross-entropy scores every token of the vocabulary") as e:
        train.train(tiny_config(tiny_data_dir, tmp_path, loss="ce", **flags))
    assert "\n" not in str(e.value) and not tmp_path.joinpath("log.jsonl").exists()


def test_a_resume_that_would_change_the_loss_is_refused(base_run, tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    for flags, name in ((dict(num_negatives=4), "num_negatives"), (dict(temperature=0.5), "temperature")):
        with pytest.raises(UserError, match=f"--{name}=.* but .* was trained with --{name}="):
            train.train(tiny_config(tiny_data_dir, out, max_iters=3, resume=True, **flags))
    train.train(tiny_config(tiny_data_dir, out, max_iters=3, resume=True, loss_chunk_size=8))  # memory only


class LearnedTemperature(train.Objective):
    """A fork's learnable temperature: declared, and given to the losses. Nothing else."""

    def __init__(self, model, config, mask=None):
        super().__init__(model, config, mask)
        self.log_temperature = torch.nn.Parameter(torch.zeros(()))

    def settings(self):
        return dataclasses.replace(self.config, temperature=self.log_temperature.exp())


class QueueOfPastTargets(train.Objective):
    """A fork's queue of the last 2 micro-batches' target ids, sized by the run (2 x the rows a micro-batch scores)
    in size_for: no change to the constructor. (A real fork would score against their embeddings as negatives.)"""

    def size_for(self, rows):
        self.register_buffer("queue", torch.full((2, rows), -1, dtype=torch.long, device=self.model.wte.weight.device))

    def forward(self, x, y, generator=None):
        with torch.no_grad():
            self.queue.copy_(torch.cat([self.queue[1:], self.scored(x, y)[1].reshape(1, -1)]))
        return super().forward(x, y, generator)


def test_a_piece_sized_by_the_run_is_declared_in_size_for_and_resumes_exactly(tiny_data_dir, tmp_path,
                                                                              monkeypatch):
    """Issue 39: the rows per micro-batch reach the objective through size_for (train.py and objective_of, as
    eval.py builds it); the queue is saved, resumed exactly and loaded for scoring."""
    monkeypatch.setattr(train, "Objective", QueueOfPastTargets)
    cfg = tiny_config(tiny_data_dir, tmp_path / "straight", max_iters=4, eval_interval=2, batch_size=2)
    train.train(cfg)
    queue = saved(tmp_path / "straight")["objective"]["queue"]
    assert queue.shape == (2, 2 * 32) and (queue >= 0).all()
    stopped = dataclasses.replace(cfg, out_dir=str(tmp_path / "resumed"), max_iters=3)
    train.train(stopped)
    train.train(dataclasses.replace(stopped, max_iters=4, resume=True))
    assert torch.equal(saved(tmp_path / "resumed")["objective"]["queue"], queue)
    ckpt = checkpoint.load_checkpoint(tmp_path / "straight" / "ckpt.safetensors", train.TrainConfig)
    loaded = train.objective_of(ckpt, checkpoint.checkpoint_model(ckpt, "ckpt"))
    assert torch.equal(loaded.queue, queue)


def test_a_resume_from_a_checkpoint_without_the_declared_piece_is_refused_in_one_line(base_run, tiny_data_dir,
                                                                                      tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)  # trained by the objective of before: no log_temperature
    monkeypatch.setattr(train, "Objective", LearnedTemperature)
    with pytest.raises(UserError) as e:
        train.train(tiny_config(tiny_data_dir, out, max_iters=3, resume=True))
    message = str(e.value)
    assert "its objective holds 'nothing', not the 'log_temperature [] float32' this run's objective declares" in \
        message and "\n" not in message and "--init_from=" in message
    # from another run's weights, a piece the source lacks starts fresh
    train.train(tiny_config(tiny_data_dir, tmp_path / "new", init_from=str(out / "ckpt.safetensors"), max_iters=1,
                            eval_interval=1))
    assert "log_temperature" in saved(tmp_path / "new")["objective"]


# ------------------------------------------------------------------------------------------ the data stream


def test_a_finetune_reads_on_in_its_pretrainings_stream(tiny_data_dir, tmp_path, monkeypatch):
    """Pre-training reads micro-batches 0..7 (4 steps of 2); its fine-tune reads 8.. on; a CE run as long as both
    together reads exactly the micro-batches they read."""
    read = []
    real_get = data.BatchSampler.get
    monkeypatch.setattr(data.BatchSampler, "get", lambda self, index: read.append(index) or real_get(self, index))
    small = dict(batch_size=2, block_size=16, eval_batches=1)
    train.train(tiny_config(tiny_data_dir, tmp_path / "cwt", max_iters=4, grad_accum=2, eval_interval=4, **small))
    assert read == list(range(8))
    read.clear()
    finetune.finetune(finetune.FinetuneConfig(ckpt=str(tmp_path / "cwt" / "ckpt.safetensors"),
                                              out_dir=str(tmp_path / "ft"), device="cpu", max_iters=3, eval_interval=3,
                                              data_root=str(tiny_data_dir.parent)))
    assert read == list(range(8, 14))
    assert saved(tmp_path / "ft")["state"]["micro_batches"] == 14
    assert saved(tmp_path / "ft")["train_config"]["seed"] == 0 == saved(tmp_path / "cwt")["train_config"]["seed"]
    read.clear()
    train.train(tiny_config(tiny_data_dir, tmp_path / "ce", loss="ce", max_iters=7, grad_accum=2, eval_interval=7,
                            **small))
    assert read == list(range(14))


# ------------------------------------------------------------------------------------------ counts and seeds


def test_an_encoders_scored_rows_are_masking_counts_everywhere(tiny_data_dir, tmp_path):
    from masking import Masking, masked_count, masked_rows, scored_rows

    run = train.Run(tiny_config(tiny_data_dir, tmp_path, objective="mlm", batch_size=8, block_size=32,
                                num_negatives=38, max_iters=1))
    x, y = run.sampler.get(0)
    x, y = run.mask.training_batch(x, 0)
    h, targets = masked_rows(torch.zeros(*y.shape, 4), y)
    assert run.scored_rows == len(targets) == scored_rows(8, 32) == 8 * masked_count(32) == 40
    assert run.candidates() == 40 and Masking(spec=run.mask.spec).scored_targets(y).tolist() == targets.tolist()
    per_token = run.model.flops_per_token(32, 40 / 256 * min(38 + 1, 40))
    assert run.flops_of(y) == pytest.approx(per_token * 256, rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 2**32 - 1), st.integers(0, 2**40))
def test_micro_batch_seeds_of_two_runs_never_meet(seed, index, other_seed, other_index):
    if (seed, index) == (other_seed, other_index):
        return
    for stream in (data.NEGATIVES_STREAM, data.DROPOUT_STREAM):
        assert data.stream_seed(seed, index, stream) != data.stream_seed(other_seed, other_index, stream)
    assert data.stream_seed(seed, index, data.NEGATIVES_STREAM) != data.stream_seed(seed, index, data.DROPOUT_STREAM)


def test_the_old_seed_collision_is_gone():
    assert 1337 * 1_000_003 + 1_000_003 == 1338 * 1_000_003 + 0  # what seed * 1_000_003 + index gave
    assert data.stream_seed(1337, 1_000_003, 1) != data.stream_seed(1338, 0, 1)
    assert 0 <= data.stream_seed(2**32 - 1, 2**40, 2) < 2**64 and isinstance(data.stream_seed(0, 0, 1), int)
    torch.Generator().manual_seed(data.stream_seed(2**32 - 1, 2**40, 2))  # a seed torch takes
    assert math.isfinite(float(np.float64(data.stream_seed(1, 2, 1))))

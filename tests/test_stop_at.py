"""Issue 56: a planned stop. `--stop_at=N` stops a run at step N as a signal would (a validation due there owed to
--resume, the checkpoint saved, the schedule still max_iters'), says so in the same line, exits 0; `--resume`
alone then continues it into the straight run, record for record and tensor for tensor."""
import contextlib
from pathlib import Path

import pytest
import torch
from helpers import read_ckpt, read_log, without_timing

import doors
import finetune
import train
from common import UserError

# train.py: --quick's shape, 8 steps, validated every 3, two micro-batches a step and dropout (its random stream)
TRAIN_FLAGS = ["--quick", "--max_iters=8", "--eval_interval=3", "--grad_accum=2", "--dropout=0.1", "--seed=3",
               "--device=cpu"]
# finetune.py: 4 steps of the head on the train.py run above, validated every 2
FINETUNE_FLAGS = ["--max_iters=4", "--eval_interval=2", "--eval_batches=1", "--log_interval=1", "--device=cpu"]
ROWS = [("train", 3), ("train", 4), ("train", 7), ("finetune", 2)]  # a validation owed at 3 and 2; 7: the last step


def run_state(out: Path) -> tuple[list[dict], dict]:
    """A run's log records (timing and ids aside) and its checkpoint: the tensors, the State and the settings
    (those of the command, "resume": "here", aside)."""
    ckpt = read_ckpt(out / "ckpt.safetensors")
    own = {k: v for k, v in ckpt["train_config"].items()
           if doors.field_meta(finetune.FinetuneConfig, k).get("resume") != "here"}
    tensors_and_state = {part: ckpt[part] for part in ("model", "objective", "optimizer", "state")}
    return without_timing(read_log(out)), {**tensors_and_state, "settings": own}


def command(script: str, data_dir: Path, base: Path) -> tuple:
    """The script's main and its flags (but --out_dir) for the runs of a row."""
    if script == "train":
        return train.main, [*TRAIN_FLAGS, f"--dataset={data_dir}"]
    return finetune.main, [*FINETUNE_FLAGS, f"--ckpt={base / 'ckpt.safetensors'}", f"--data_root={data_dir.parent}"]


@contextlib.contextmanager
def small_tiny_preset():
    """conftest's small_tiny_preset, for a module's fixture."""
    import model
    presets = dict(model.PRESETS)
    model.PRESETS["tiny"] = dict(n_layer=2, n_head=2, d_model=64, block_size=64)
    try:
        yield
    finally:
        model.PRESETS.clear()
        model.PRESETS.update(presets)


@pytest.fixture(scope="module")
def straight_train(tiny_data_dir, tmp_path_factory) -> Path:
    """train.py's straight run (the fine-tune's base too), once a module and worker."""
    out = tmp_path_factory.mktemp("straight") / "train"
    with small_tiny_preset():
        train.main([*command("train", tiny_data_dir, out)[1], f"--out_dir={out}"])
    return out


@pytest.fixture(scope="module")
def straight_finetune(straight_train, tiny_data_dir) -> Path:
    """finetune.py's straight run from it."""
    out = straight_train.parent / "finetune"
    with small_tiny_preset():
        finetune.main([*command("finetune", tiny_data_dir, straight_train)[1], f"--out_dir={out}"])
    return out


@pytest.mark.usefixtures("small_tiny_preset")
@pytest.mark.parametrize("script, stop_at", ROWS)
def test_a_run_stopped_by_stop_at_then_resumed_alone_is_the_straight_run(script, stop_at, straight_train, tiny_data_dir,
                                                                        tmp_path, capsys, request):
    main, flags = command(script, tiny_data_dir, straight_train)
    want_records, want = run_state(request.getfixturevalue(f"straight_{script}"))
    out = tmp_path / "stopped"
    capsys.readouterr()
    assert main([*flags, f"--stop_at={stop_at}", f"--out_dir={out}"]) is None  # no Interrupted: exit 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"stopped at step {stop_at}; checkpoint saved to {out / 'ckpt.safetensors'}; continue with --resume")
    stopped = read_ckpt(out / "ckpt.safetensors")["state"]
    assert stopped["step"] == stop_at and stopped["val_step"] < stop_at  # a validation due at the stop is owed
    main(["--resume", f"--out_dir={out}", f"--data_root={tiny_data_dir.parent}", "--device=cpu"])
    records, saved = run_state(out)
    assert records == want_records
    assert saved["state"] == want["state"] and saved["settings"] == want["settings"]
    for part in ("model", "objective"):
        assert saved[part].keys() == want[part].keys()
        for name, tensor in want[part].items():
            assert torch.equal(saved[part][name], tensor), (part, name)
    assert saved["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for key, entry in want["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(saved["optimizer"]["state"][key][name]), torch.as_tensor(value))


@pytest.mark.usefixtures("small_tiny_preset")
@pytest.mark.parametrize("flags, words", [
    (["--stop_at=8"], "--stop_at=8 changes nothing: the run ends at --max_iters=8; drop it, or stop earlier"),
    (["--stop_at=20"], "--stop_at=20 changes nothing: the run ends at --max_iters=8"),
    (["--stop_at=0"], "--stop_at must be in [1, 4294967296], got 0"),
    (["--resume", "--stop_at=8", "--max_iters=20"], "--stop_at=8 but the run is at step 8 already; pass a later "
                                                    "step (below --max_iters=20), or drop it"),
])
def test_a_stop_at_that_would_change_nothing_is_refused_in_one_line(flags, words, straight_train, tiny_data_dir,
                                                                    tmp_path):
    """A --stop_at at or past the end, or not after the step a resumed run is at, is refused before any work."""
    out = tmp_path / "run"
    if "--resume" in flags:  # a copy of the finished straight run
        out.mkdir()
        for name in ("ckpt.safetensors", "log.jsonl"):
            (out / name).write_bytes((straight_train / name).read_bytes())
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.raises(UserError) as refused:
        own = [f for f in TRAIN_FLAGS if f != "--quick" or "--resume" not in flags]  # a resumed run keeps its own
        train.main([*own, f"--dataset={tiny_data_dir}", *flags, f"--out_dir={out}"])
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before

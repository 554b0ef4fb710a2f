"""tracking.py: --tensorboard and --wandb get every record of log.jsonl, at its step; a resumed run continues the
same curves with no repeated step, a new run starts them over. Read back as a user's tools read them: TensorBoard's
EventAccumulator, and the offline W&B run's own file under out_dir. Never the network: W&B runs offline."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_log, tiny_config

import common
import compare
import data
import devices
import finetune
import plan
import train
from common import UserError

pytestmark = pytest.mark.usefixtures("small_tiny_preset")
ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(block_size=16, batch_size=2, max_iters=4, warmup_iters=1, eval_interval=2, eval_batches=1)


def expected_curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """log.jsonl's records as curves: every key but the step, under val/ in a validation record, else train/."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        group = "val" if "val_ce" in r else "train"
        for key, value in r.items():
            if key not in ("step", "run_id", "changed"):  # the run's id, a resume's changes: no curve
                curves.setdefault(f"{group}/{key}", []).append((r["step"], value))
    return curves


def tensorboard_curves(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_same_curves(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [step for step, _ in got[tag]] == [step for step, _ in points], tag  # each step once, in order
        assert [value for _, value in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag  # fp32


def test_tensorboard_holds_log_jsonl_and_a_resume_continues_it_without_repeats(tiny_data_dir, tmp_path,
                                                                                monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(devices, "peak_flops", lambda device: 1e12)  # as on a GPU of known peak: MFU is logged
    out = tmp_path / "out"
    cfg = tiny_config(tiny_data_dir, out, tensorboard=True, **SMALL)
    train.train(cfg)
    records = read_log(out)
    assert {"loss", "lr", "tokens_per_s", "mfu"} <= records[1].keys() and "val_bpb" in records[0]
    assert_same_curves(tensorboard_curves(out / "tb"), expected_curves(records))
    # A run stopped at step 2 whose curves went on to step 4 (killed after its log, before its checkpoint):
    # resumed, the steps after its checkpoint are purged, and the curves are the finished run's, each step once.
    early = tmp_path / "early"
    train.train(tiny_config(tiny_data_dir, early, **{**SMALL, "max_iters": 2}))
    shutil.copy(early / "ckpt.safetensors", out / "ckpt.safetensors")
    same_run = read_log(early)[0]["run_id"]  # one run's checkpoint and log: its id in both (else a resume refuses)
    (out / "log.jsonl").write_text("".join(json.dumps({**r, "run_id": same_run}) + "\n" for r in read_log(out)))
    train.train(tiny_config(tiny_data_dir, out, tensorboard=True, resume=True, **SMALL))
    resumed = read_log(out)
    assert [r["step"] for r in resumed] == [r["step"] for r in records]
    assert_same_curves(tensorboard_curves(out / "tb"), expected_curves(resumed))
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 2  # the purge is on read, as TensorBoard's
    # --overwrite starts them over: tracking's files go, nothing else does
    (out / "tb" / "notes.txt").write_text("mine")
    train.train(tiny_config(tiny_data_dir, out, tensorboard=True, overwrite=True, **{**SMALL, "max_iters": 2}))
    assert_same_curves(tensorboard_curves(out / "tb"), expected_curves(read_log(out)))
    assert max(step for points in tensorboard_curves(out / "tb").values() for step, _ in points) == 2
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1 and (out / "tb" / "notes.txt").exists()
    # finetune.py takes the flag as train.py does (its runs are train.py's loop)
    finetune.finetune(finetune.FinetuneConfig(ckpt=str(out / "ckpt.safetensors"), max_iters=1, eval_interval=1,
                                              log_interval=1, out_dir=str(tmp_path / "ft"), tensorboard=True,
                                              data_root=str(tiny_data_dir.parent)))
    assert_same_curves(tensorboard_curves(tmp_path / "ft" / "tb"), expected_curves(read_log(tmp_path / "ft")))


def wandb_records(path: Path) -> list:
    """The protobuf Records of a W&B run's record log (its .wandb file): LevelDB's log format, 32 KiB blocks of
    chunks, each with a 7-byte header (CRC, length, type: 1 whole, 2 first, 3 middle, 4 last), after a 7-byte file
    header (':W&B', magic, version)."""
    from wandb.proto import wandb_internal_pb2

    data, records = path.read_bytes(), []
    assert data[:4] == b":W&B"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(b"".join(parts)))
            parts = []
    return records


def wandb_runs(out_dir: Path) -> list[tuple[str, list]]:
    """Each offline W&B run under out_dir as (the run id its run record holds, its records), the first started
    first (its run record's start time). Read from what W&B records, not from its folders' names: a run started
    within the second of another of its id gets the folder offline-run-TIME-ID-1."""
    runs = []
    for path in (out_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        records = wandb_records(path)
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        runs.append((run.start_time.ToNanoseconds(), run.run_id, records))
    return [(run_id, records) for _, run_id, records in sorted(runs, key=lambda run: run[0])]


def wandb_history(out_dir: Path) -> list[dict]:
    """Every history row of the offline W&B runs under out_dir, the first run's first."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for _, records in wandb_runs(out_dir) for r in records
            if r.WhichOneof("record_type") == "history"]  # "train/loss" comes as nested keys


def wandb_curves(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith("_"):  # W&B's own: _step, _runtime, _timestamp
                curves.setdefault(key, []).append((row["_step"], value))
    return curves


class SameSecond:
    """W&B's clock (wandb.init reads time.time() once, its run's start), held within one second: each run starts a
    millisecond after the one before, so their folders' names, of that second, collide."""

    def __init__(self, clock):
        self.clock, self.runs = clock, 0

    def time(self) -> float:
        self.runs += 1
        return 1_767_225_600 + self.runs / 1000

    def __getattr__(self, name: str):
        return getattr(self.clock, name)


def test_wandb_offline_without_network_holds_log_jsonl_under_out_dir(tiny_data_dir, tmp_path, monkeypatch,
                                                                     capsys):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_BASE_URL", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))

    connect = socket.create_connection

    def loopback_only(address, *args, **kwargs):  # W&B's own service process is reached on the loopback
        if address[0] not in ("localhost", "127.0.0.1", "::1"):
            raise OSError(f"network unreachable (the test): {address[0]}")
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", loopback_only)  # no network: offline by itself
    out = tmp_path / "out"
    from wandb.sdk import wandb_init
    monkeypatch.setattr(wandb_init, "time", SameSecond(wandb_init.time))
    train.train(tiny_config(tiny_data_dir, out, wandb=True, wandb_run_name="tiny-cwt", **{**SMALL, "max_iters": 2}))
    assert "W&B server cannot be reached: --wandb logs offline" in capsys.readouterr().err
    assert_same_curves(wandb_curves(wandb_history(out)), expected_curves(read_log(out)))
    ((first, _),) = wandb_runs(out)
    # resumed within the same second (on a quick machine; W&B's clock held here): the same run id goes on from the
    # checkpoint, in a folder whose name ends in -1 (the test took that for the id: it failed 2 runs in 5)
    train.train(tiny_config(tiny_data_dir, out, wandb=True, resume=True, **SMALL))
    assert_same_curves(wandb_curves(wandb_history(out)), expected_curves(read_log(out)))
    assert [run_id for run_id, _ in wandb_runs(out)] == [first, first]
    assert len(list((out / "wandb").glob(f"offline-run-*-{first}-1"))) == 1  # the folders' names collided
    # resumed again: the run it continues is the last one, whose folder's last field is 1 (it went on as run "1")
    train.train(tiny_config(tiny_data_dir, out, wandb=True, resume=True, **{**SMALL, "max_iters": 6}))
    assert_same_curves(wandb_curves(wandb_history(out)), expected_curves(read_log(out)))
    assert [run_id for run_id, _ in wandb_runs(out)] == [first, first, first]
    # --overwrite: a new run, its files only
    train.train(tiny_config(tiny_data_dir, out, wandb=True, overwrite=True, **{**SMALL, "max_iters": 2}))
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    assert_same_curves(wandb_curves(wandb_history(out)), expected_curves(read_log(out)))


@pytest.mark.parametrize("folders, last", [
    (["offline-run-20260101_000000-aaa", "offline-run-20260101_000001-bbb"], "bbb"),
    (["offline-run-20260101_000000-abc", "offline-run-20260101_000000-abc-1"], "abc"),  # it was "1"
    (["offline-run-20260101_000001-off", "run-20260101_000002-onl-1", "run-20260101_000002-onl"], "onl")])
def test_a_resume_continues_the_last_wandb_run_whatever_its_folder_is_called(folders, last, tmp_path):
    """The id a resumed run goes on with is the one W&B records (run-ID.wandb in the run's folder), of the run
    started last: the folders' time, then the -N W&B adds to a run of an id started within the same second."""
    import tracking

    for name in folders:
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / f"run-{name.removeprefix('offline-').split('-')[2]}.wandb").write_bytes(b":W&B")
    assert tracking.earlier_wandb_id(tmp_path) == last


def test_without_the_flags_neither_package_nor_tracking_is_imported(tiny_data_dir, tmp_path, monkeypatch):
    for name in ("tensorboard", "wandb", "tracking", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    train.train(tiny_config(tiny_data_dir, tmp_path / "out", **{**SMALL, "max_iters": 1}))
    assert not (tmp_path / "out" / "tb").exists() and not (tmp_path / "out" / "wandb").exists()


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_missing_package_or_tracking_py_is_one_line_before_any_work(package, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    one_line = rf"^--{package} needs {package}, an optional extra: pip install {package}$"
    for check, config in ((plan.check_config, train.TrainConfig), (compare.check_config, compare.CompareConfig)):
        with pytest.raises(UserError, match=one_line):
            check(config(**{package: True}))
    monkeypatch.setitem(sys.modules, "tracking", None)  # a fork deleted tracking.py
    with pytest.raises(UserError, match="needs tracking.py, which is not in this checkout"):
        plan.check_config(train.TrainConfig(**{package: True}))


def test_compare_passes_the_flags_to_each_of_its_runs(tmp_path):
    cfg = compare.CompareConfig(out_dir=str(tmp_path), tensorboard=True, wandb=True, wandb_project="p",
                                wandb_run_name="study")
    runs = [compare.pretrain_config(cfg, "ce", 4, tmp_path / "ce"),
            compare.finetune_config(cfg, tmp_path / "cwt" / "ckpt.safetensors", 1, tmp_path / "b2-cwt-s7" / "cwt-ft")]
    assert [(r.tensorboard, r.wandb, r.wandb_project, r.wandb_run_name) for r in runs] == [
        (True, True, "p", "study/ce"), (True, True, "p", "study/b2-cwt-s7/cwt-ft")]
    unnamed = compare.pretrain_config(compare.CompareConfig(out_dir=str(tmp_path)), "ce", 4, tmp_path / "ce")
    assert (unnamed.tensorboard, unnamed.wandb, unnamed.wandb_run_name) == (False, False, "")  # named by out_dir


def offline_wandb_env(tmp_path: Path) -> dict[str, str]:
    home = str(tmp_path / "wandb-home")
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
            "WANDB_CONFIG_DIR": home, "WANDB_CACHE_DIR": home, "WANDB_DATA_DIR": home}


def wait_for_record(out: Path, ready, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            if any(ready(r) for r in read_log(out)):
                return
        time.sleep(0.1)
    pytest.fail(f"no such record in {out / 'log.jsonl'} (exit {proc.poll()}): {proc.stderr.read()[-2000:]}")


def test_a_run_killed_outright_keeps_its_wandb_history_but_its_last_fraction_of_a_second(tiny_data_dir, tmp_path):
    """As the review killed one (SIGKILL to the run and its W&B process, 2 s after a validation): W&B's file holds
    the records log.jsonl holds, in order, up to within WANDB_FLUSH_SECONDS of the kill (before, W&B's 15 s buffer
    left its file empty: a 7-byte header)."""
    pytest.importorskip("wandb")
    import tracking

    out = tmp_path / "out"
    flags = [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--device=cpu", "--wandb", "--n_layer=1", "--n_head=2",
             "--d_model=32", "--block_size=16", "--batch_size=2", "--max_iters=100000", "--eval_interval=2",
             "--eval_batches=1", "--log_interval=1", "--warmup_iters=1"]
    env = {**os.environ, **offline_wandb_env(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_record(out, lambda r: r["step"] >= 3, proc)  # step 2's validation logged, and W&B's row of step 2
        time.sleep(10 * tracking.WANDB_FLUSH_SECONDS)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its wandb-core: nothing gets to flush
        proc.wait()
    got, want = wandb_curves(wandb_history(out)), expected_curves(read_log(out))
    assert "val/val_ce" in got and set(got) <= set(want), f"W&B's file holds {sorted(got)}"
    assert [step for step, _ in got["val/val_ce"]][:2] == [0, 2]  # the validations before the kill
    for tag, points in got.items():  # every record W&B holds is log.jsonl's, in order: none lost but the last
        assert [step for step, _ in points] == [step for step, _ in want[tag][:len(points)]], tag
        assert [v for _, v in points] == pytest.approx([v for _, v in want[tag][:len(points)]], rel=1e-6), tag


def test_a_run_stopped_by_a_signal_keeps_every_wandb_record(tiny_data_dir, tmp_path, monkeypatch):
    """SIGTERM (as Ctrl-C) stops the loop, which finishes the W&B run: its file holds every record of log.jsonl."""
    pytest.importorskip("wandb")
    for name, value in offline_wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_MODE")  # read once a process by wandb: offline as no server answers, said to init
    monkeypatch.setattr(common, "reachable", lambda url: False)
    real_get = data.BatchSampler.get

    def terminated_at_step_3(sampler, index):
        if index == 3:
            signal.raise_signal(signal.SIGTERM)
        return real_get(sampler, index)

    monkeypatch.setattr(data.BatchSampler, "get", terminated_at_step_3)
    out = tmp_path / "out"
    summary = train.train(tiny_config(tiny_data_dir, out, wandb=True, **{**SMALL, "max_iters": 10}))
    assert summary["interrupted"] and summary["signal"] == signal.SIGTERM and summary["step"] == 4
    records = read_log(out)
    assert records[-1]["step"] == 4
    assert_same_curves(wandb_curves(wandb_history(out)), expected_curves(records))


def test_a_trackers_file_no_run_recorded_writing_is_refused_and_kept(tiny_data_dir, tmp_path):
    """Issue 42, contract 7: tracking deletes only what it recorded writing (out_dir/tracked.jsonl); a user's own
    event file in out_dir/tb is refused before any work, never deleted, never mixed with the run's curves."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    (out / "tb").mkdir(parents=True)
    (out / "tb" / "events.out.tfevents.mine").write_bytes(b"my curves")
    with pytest.raises(common.UserError, match=r"events.out.tfevents.mine is a tensorboard file that no run in "
                                               r"--out_dir recorded writing"):
        train.train(tiny_config(tiny_data_dir, out, tensorboard=True, **{**SMALL, "max_iters": 1}))
    assert sorted(p.name for p in out.rglob("*")) == ["events.out.tfevents.mine", "tb"]
    (out / "tb" / "events.out.tfevents.mine").rename(tmp_path / "kept")
    train.train(tiny_config(tiny_data_dir, out, tensorboard=True, **{**SMALL, "max_iters": 1}))
    written = [json.loads(line) for line in (out / "tracked.jsonl").read_text().splitlines()]
    assert written == [f"tb/{p.name}" for p in (out / "tb").iterdir()] and len(written) == 1
    # --overwrite removes the recorded file and keeps the rest: test_tensorboard_holds_log_jsonl_and_a_resume_...

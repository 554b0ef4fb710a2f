"""Fixtures shared by every test file.

Tests never touch the network: the Hugging Face libraries are switched to offline mode before
anything imports them (an unreachable hub otherwise costs ~25 s of retries per call).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if "PYTEST_XDIST_WORKER" in os.environ:  # `pytest -n 2`: each worker has a core; tiny ops gain nothing from threads
    os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # flat layout: `import data`, `import model`

import pytest  # noqa: E402

import prepare

# A shell starts background jobs (`pytest ... &`) with SIGINT ignored, which Python keeps: the tests that press
# Ctrl-C with signal.raise_signal need it to raise KeyboardInterrupt, as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A fork's check in a minute (README): `python -m pytest -q -n 2 -m core tests` runs the tests that guard the core's
# contracts: the losses against float64, the model, a run's exact resume (stopped by a signal, or by --stop_at), the
# checkpoint door, the architecture (test_style), the fork recipes. A file, or a file's tests by the start of a name.
CORE = ("test_loss.py", "test_model.py", "test_style.py", "test_hackable.py", "test_stop_at.py",
        "test_train.py::test_interrupt_then_resume_is_exact", "test_doors.py::test_the_checkpoint_door_",
        "test_doors.py::test_any_value_in_any_field_is_let_in_or_refused",
        "test_doors.py::test_a_checkpoint_written_by_todays_main")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "core: a test that guards the core's contracts (conftest.CORE; -m core)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark CORE's tests. An entry that names no test of a file collected is an error: a renamed test would
    otherwise leave the check without a word (a renamed file: tests/test_style.py)."""
    collected = {item.path.name for item in items}
    for entry in CORE:
        file = entry.partition("::")[0]
        matched = [item for item in items if f"{item.path.name}::{item.name}".startswith(entry if "::" in entry
                                                                                       else f"{file}::")]
        if file in collected and not matched:
            raise pytest.UsageError(f"conftest.CORE names {entry}, which matches no test of {file}; update CORE")
        for item in matched:
            item.add_marker(pytest.mark.core)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared dataset: the first 4 Shakespeare plays, gpt2 tokens; at --val_fraction=0.25 their
    hashes hold out the fourth whole (~90k train / ~35k val tokens). Built by prepare.prepare in ~2 seconds."""
    root = tmp_path_factory.mktemp("data")
    prepare.prepare(prepare.PrepareConfig(dataset="shakespeare", max_docs=4, val_fraction=0.25, data_root=str(root)))
    return root / "shakespeare"


@pytest.fixture
def small_tiny_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the `tiny` preset for in-process training tests: the loop is the same, only faster."""
    import model

    monkeypatch.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: two ranks share the CPU cores with the test process, and
    token-by-token decoding of tiny models is all thread overhead; oversubscribed threads only slow both."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def refused_before_any_work(main, argv: list[str], message: str, root: Path) -> None:
    """main(argv) refuses in one line naming `message`, and writes nothing under root. In argv, OUT is root,
    CKPT a stand-in checkpoint and LATIN1 a file that is not UTF-8."""
    from helpers import save_ckpt

    from common import UserError

    save_ckpt({"model": {}, "model_config": {}, "train_config": {"batch_size": 8, "preset": "tiny"}},
               root / "base.pt")
    (root / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    subs = {"OUT": str(root), "CKPT": str(root / "base.pt"), "LATIN1": str(root / "latin1.txt")}
    argv = [a.replace("CKPT", subs["CKPT"]).replace("LATIN1", subs["LATIN1"]).replace("OUT", subs["OUT"])
            for a in argv]
    before = sorted(root.iterdir())
    with pytest.raises(UserError) as e:
        main(argv)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert sorted(root.iterdir()) == before  # no output folder, no temp file


@pytest.fixture(scope="module")
def command_worker():
    """One process that runs `python SCRIPT.py ARGV` as the command line would (common.run_main: its stderr, its exit
    code), command after command: a table of refusals pays for torch's import once (helpers.Worker)."""
    from helpers import Worker

    worker = Worker(("train", "finetune"))
    yield worker
    worker.close()

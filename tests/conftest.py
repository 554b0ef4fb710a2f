"""Fixtures shared by every test file.

Tests never touch the network: the Hugging Face libraries are switched to offline mode before
anything imports them (an unreachable hub otherwise costs ~25 s of retries per call).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # flat layout: `import data`, `import model`

import pytest  # noqa: E402

import data  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared dataset: the first 4 Shakespeare plays, gpt2 tokens; at --val_fraction=0.25 their
    hashes hold out the fourth whole (~90k train / ~35k val tokens). Built by data.prepare in ~2 seconds."""
    root = tmp_path_factory.mktemp("data")
    data.prepare(data.PrepareConfig(dataset="shakespeare", max_docs=4, val_fraction=0.25, data_root=str(root)))
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


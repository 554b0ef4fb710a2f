"""Where two features meet: a checkpoint's head and the next run's loss, an imported model's fine-tune budget,
the validation split, chunked validation, and resuming with another split of each step."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex

import numpy as np
import pytest
import torch
from helpers import read_ckpt, save_ckpt, tiny_config

import data
import finetune
import prepare
import train
from common import UserError

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


@pytest.fixture(scope="module")
def untied_ce(tiny_data_dir, tmp_path_factory):
    """A CE checkpoint with an untied head (as Pythia's), 4 steps."""
    out = tmp_path_factory.mktemp("untied")
    with pytest.MonkeyPatch.context() as mp:
        import model
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        train.train(tiny_config(tiny_data_dir, out, loss="ce", untied_head=True, max_iters=4, eval_interval=4))
    return out / "ckpt.safetensors"


def test_cwt_from_a_checkpoint_with_a_head_drops_it_and_says_so(untied_ce, tiny_data_dir, tmp_path, capsys):
    train.train(tiny_config(tiny_data_dir, tmp_path, loss="cwt", init_from=str(untied_ce), max_iters=2))
    assert "has an untied LM head, but --loss=cwt trains a headless model: the head is dropped" in \
        capsys.readouterr().err
    ckpt = read_ckpt(tmp_path / "ckpt.safetensors")
    assert "lm_head.weight" not in ckpt["model"] and ckpt["model_config"]["lm_head"] is False


def test_ce_from_a_checkpoint_with_a_head_keeps_and_trains_it(untied_ce, tiny_data_dir, tmp_path):
    before = read_ckpt(untied_ce)["model"]["lm_head.weight"]
    train.train(tiny_config(tiny_data_dir, tmp_path, loss="ce", init_from=str(untied_ce), max_iters=2))
    after = read_ckpt(tmp_path / "ckpt.safetensors")["model"]["lm_head.weight"]
    assert not torch.equal(before, after)


def test_untied_head_with_init_from_makes_a_head_from_the_embeddings(tiny_data_dir, tmp_path):
    train.train(tiny_config(tiny_data_dir, tmp_path / "tied", loss="ce", max_iters=2))
    tied = read_ckpt(tmp_path / "tied" / "ckpt.safetensors")["model"]
    cfg = tiny_config(tiny_data_dir, tmp_path / "untied", loss="ce", untied_head=True, max_iters=1, lr=1e-9,
                      init_from=str(tmp_path / "tied" / "ckpt.safetensors"))
    train.train(cfg)
    head = read_ckpt(tmp_path / "untied" / "ckpt.safetensors")["model"]["lm_head.weight"]
    torch.testing.assert_close(head, tied["wte.weight"], rtol=0, atol=1e-6)  # E, barely moved by lr 1e-9


def test_finetuning_a_model_without_a_token_count_asks_for_a_budget(tiny_data_dir, tmp_path, capsys):
    train.train(tiny_config(tiny_data_dir, tmp_path / "base", max_iters=2))
    ckpt = read_ckpt(tmp_path / "base" / "ckpt.safetensors")
    for key in ("state", "optimizer", "rng"):  # an imported (hf:) model's none
        ckpt.pop(key)
    save_ckpt(ckpt, tmp_path / "imported.pt")
    cfg = finetune.FinetuneConfig(ckpt=str(tmp_path / "imported.pt"), out_dir=str(tmp_path / "ft"),
                                  data_root=str(tiny_data_dir.parent))
    with pytest.raises(UserError, match=r"records no pre-training tokens .* pass --tokens=N or --max_iters=N "
                                        r"\(Pythia: 2% of 300B is --tokens=6e9\)"):
        finetune.finetune(cfg)
    assert not (tmp_path / "ft").exists()
    capsys.readouterr()
    summary = finetune.finetune(dataclasses.replace(cfg, tokens=3 * 8 * 32, eval_batches=1))
    assert summary["step"] == 3
    err = capsys.readouterr().err  # no share of an unknown count, and no nan
    assert "(pre-training tokens unknown)" in err and "nan" not in err and "% of pre-training" not in err


def test_resuming_with_another_untied_head_is_refused(tiny_data_dir, tmp_path):
    train.train(tiny_config(tiny_data_dir, tmp_path, loss="ce", max_iters=2))
    with pytest.raises(UserError, match=r"--untied_head=True but .* was trained with --untied_head=False"):
        train.train(tiny_config(tiny_data_dir, tmp_path, loss="ce", untied_head=True, max_iters=3, resume=True))


@pytest.mark.parametrize("fields, message", [
    ({}, "prepared by an older rule that cut every document into train and val"),  # no split_rule: the first
    ({"split_rule": 2}, "prepared before val.bytes (bits per byte) was recorded"),
])
def test_a_dataset_of_an_older_format_is_refused_and_shakespeare_is_prepared_again(fields, message, tmp_path,
                                                                                   capsys):
    for name in ("books", "shakespeare"):
        folder = tmp_path / name
        folder.mkdir()
        meta = {"tokenizer": "gpt2", "vocab_size": 50257, "dtype": "uint16", "eot_token": 50256,
                "train_tokens": 0, "val_tokens": 0, "checksums": {}, "settings": {"dataset": name}, **fields}
        (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=re.escape(f"{message}; prepare its corpus again with python prepare.py "
                                                  "--dataset=books")):
        data.load_meta(tmp_path / "books")
    out = prepare.ensure_dataset("shakespeare", str(tmp_path))
    assert "preparing the built-in shakespeare dataset" in capsys.readouterr().err
    assert data.load_meta(out)["format"] == data.DATA_FORMAT and data.load_meta(out)["documents"] == 38


def test_the_command_a_refusal_builds_from_a_files_text_is_quoted_for_the_shell(tmp_path):
    """Issue 50: a meta.json's source pasted into the command that prepares it again is one quoted argument, never a
    command substitution a shell would run."""
    folder = tmp_path / "my data" / "books"
    folder.mkdir(parents=True)
    source = "corpus $(touch PWNED) `touch PWNED`"
    (folder / "meta.json").write_text(json.dumps({"settings": {"dataset": source}, "split_rule": 2}))
    with pytest.raises(UserError) as e:
        data.load_meta(folder)
    command = str(e.value).split("prepare its corpus again with ", 1)[1]
    assert shlex.split(command) == ["python", "prepare.py", f"--dataset={source}", f"--data_root={folder.parent}"]


def test_bits_per_byte_equals_a_float64_computation_from_the_tokens():
    # Two sequences over a toy vocabulary: id 3 is special (no bytes, no bits); the others stand for 1-3 bytes.
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1, d_model=8)).double()
    # The bytes each position stands for come with the data (one token of id 5 stands for 0 bytes: a piece of
    # a character whose bytes an earlier piece counted, which still costs bits).
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 3, 7, 1, 2, 5, 3, 6]).numpy()
    counts = np.array([1, 2, 3, 0, 1, 2, 0, 1, 1, 2, 0, 0, 2], dtype=np.uint32)
    objective = train.Objective(model, train.LossConfig(loss="ce"))
    got = train.evaluate(objective, train.ValSplit(tokens, counts, [3]),
                         train.Validation(batch_size=2, block_size=6))["val_bpb"]
    bits = n_bytes = 0.0
    with torch.no_grad():
        for start in (0, 6):  # the two non-overlapping windows of 6 + 1 tokens
            x, y = torch.tensor(tokens[start:start + 6]), torch.tensor(tokens[start + 1:start + 7])
            logp = torch.log_softmax(model(x[None])[0].double(), dim=-1)
            for t, target in enumerate(y.tolist()):
                if target != 3:
                    bits -= logp[t, target].item() / math.log(2)
                n_bytes += int(counts[start + 1 + t])
    assert got == pytest.approx(bits / n_bytes, rel=1e-9)


def record_batches(monkeypatch) -> list[int]:
    seen, real = [], data.BatchSampler.get

    def get(self, index):
        seen.append(index)
        return real(self, index)
    monkeypatch.setattr(data.BatchSampler, "get", get)
    return seen


def test_resuming_with_another_grad_accum_continues_with_the_next_unseen_batch(tiny_data_dir, tmp_path,
                                                                              monkeypatch):
    seen = record_batches(monkeypatch)
    cfg = tiny_config(tiny_data_dir, tmp_path, grad_accum=2, max_iters=3, eval_interval=10)
    train.train(cfg)
    assert seen == [0, 1, 2, 3, 4, 5]
    seen.clear()
    # grad_accum=1 is its default: named as given, or --resume would keep the run's own 2
    summary = train.train(dataclasses.replace(cfg, grad_accum=1, max_iters=5, resume=True),
                          given={"grad_accum", "max_iters", "resume"})
    assert seen == [6, 7]  # not 3, 4: the data position is the count of micro-batches consumed
    assert summary["tokens"] == (6 + 2) * 8 * 32  # summed as spent, not steps x today's tokens per step
    state = read_ckpt(tmp_path / "ckpt.safetensors")["state"]
    assert (state["micro_batches"], state["tokens"]) == (8, 8 * 8 * 32)


def test_a_checkpoint_from_before_the_count_is_refused_for_resume_and_starts_a_run(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path / "old", grad_accum=2, max_iters=3, eval_interval=10)
    train.train(cfg)
    ckpt = read_ckpt(tmp_path / "old" / "ckpt.safetensors")
    state = ckpt.pop("state")  # as written before the data position was counted: its counts beside the weights
    save_ckpt({**ckpt, "step": state["step"], "tokens_seen": state["tokens"]}, tmp_path / "old" / "ckpt.safetensors")
    with pytest.raises(UserError, match=r"in an earlier layout .*\(counts beside its state: step, tokens_seen\), "
                       r"which no script reads; convert it once: .*convert\.py"):
        train.train(dataclasses.replace(cfg, max_iters=4, resume=True))
    save_ckpt({**ckpt, "state": {**state, "micro_batches": None}}, tmp_path / "old" / "ckpt.safetensors")  # converted
    with pytest.raises(UserError, match="cannot resume exactly; start a new run from its weights with --init_from="):
        train.train(dataclasses.replace(cfg, max_iters=4, resume=True))
    summary = train.train(dataclasses.replace(cfg, out_dir=str(tmp_path / "new"), init_from=str(tmp_path / "old" /
                                                                                              "ckpt.safetensors")))
    assert summary["step"] == 3 and summary["tokens"] == 2 * 3 * 2 * 8 * 32

"""glue.py: GLUE's metrics against hand-computed values, input encoding, errors, and an end-to-end run."""
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from conftest import refused_before_any_work
from helpers import io_pairs, refusal, tree_state

import glue
import model as model_module
import train
from checkpoint import save_checkpoint
from common import UserError
from glue import TASKS, accuracy, f1, matthews, pearson, spearman
from model import GPT, GPTConfig
from tokenizer import load_tokenizer
from train import TrainConfig


def test_metrics_against_hand_computed_values():
    pred, gold = np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 1])
    assert accuracy(pred, gold) == pytest.approx(3 / 5)
    assert f1(pred, gold) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # tp 2, fp 1, fn 1
    # tp 2, tn 1, fp 1, fn 1
    assert matthews(pred, gold) == pytest.approx((2 * 1 - 1 * 1) / np.sqrt(3 * 3 * 2 * 2))
    assert matthews(np.ones(4), np.array([1, 0, 1, 0])) == 0.0  # constant predictions: 0, as sklearn
    # x deviations (-1.5 -0.5 0.5 1.5), y deviations (-3.25 -1.25 0.75 3.75): 11.5 / sqrt(5 * 26.75)
    x, y = np.array([1., 2, 3, 4]), np.array([2., 4, 6, 9])
    assert pearson(x, y) == pytest.approx(11.5 / np.sqrt(5 * 26.75))
    # ties share their mean rank: x ranks (1, 2.5, 2.5, 4), y ranks (1, 3, 2, 4) -> 4.5 / sqrt(4.5 * 5)
    x, y = np.array([1., 2, 2, 3]), np.array([1., 3, 2, 4])
    assert spearman(x, y) == pytest.approx(4.5 / np.sqrt(4.5 * 5))
    mismatched = glue.task_metrics(TASKS["mnli"], "validation_mismatched", pred, gold)
    assert mismatched == {"accuracy_mismatched": 0.6}
    assert set(glue.task_metrics(TASKS["qqp"], "validation", pred, gold)) == {"f1", "accuracy"}


def test_pairs_are_joined_by_the_separator_and_truncated_longest_first():
    assert glue.truncate_pair([1, 2, 3, 4, 5], [6, 7, 8], 6) == ([1, 2, 3], [6, 7, 8])
    assert glue.truncate_pair([1, 2], [3, 4], 3) == ([1, 2], [3])  # a tie cuts the second
    tok = load_tokenizer("gpt2")
    rows = [{"sentence1": "Hello world", "sentence2": "Good night", "label": 1}]
    [ids] = glue.encode_rows(rows, TASKS["rte"], tok, tok.eot_token, 128)
    assert ids == tok.encode_ordinary("Hello world") + [tok.eot_token] + tok.encode_ordinary("Good night")
    assert glue.encode_rows([{"sentence": "", "label": 0}], TASKS["sst2"], tok, 9, 8) == [[9]]  # never empty


def test_bad_rows_are_one_line_errors():
    with pytest.raises(UserError, match="lacks sentence2"):
        glue.check_rows([{"sentence1": "a", "label": 0}], TASKS["mrpc"], "x")
    with pytest.raises(UserError, match="no labels"):
        glue.check_rows([{"sentence": "a", "label": -1}], TASKS["cola"], "x")
    labels = glue.check_rows([{"sentence1": "a", "sentence2": "b", "label": 3.2}], TASKS["stsb"], "x")
    assert labels.dtype == float
    with pytest.raises(UserError, match="choose one of"):
        glue.parse_flags(glue.GlueConfig, ["--task=squad"])


def keyword_task(folder, n_train=160, n_val=80):
    """SST-2-like rows: filler words plus one positive or negative keyword, which decides the label."""
    rng = random.Random(0)
    filler = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with", "as", "his", "that", "by",
              "at", "from"]
    folder.mkdir()
    for split, n in (("train", n_train), ("validation", n_val)):
        rows = []
        for _ in range(n):
            label = rng.randint(0, 1)
            words = rng.sample(filler, 5) + [rng.choice(["great", "lovely"] if label else ["awful", "dull"])]
            rng.shuffle(words)
            rows.append({"sentence": " ".join(words), "label": label})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_mlm_pretraining_then_glue_well_above_chance(tiny_data_dir, tmp_path, monkeypatch, capsys):
    small = dict(n_layer=2, n_head=2, d_model=64, block_size=32)
    monkeypatch.setitem(model_module.PRESETS, "bert-tiny", small)
    train.train(TrainConfig(dataset=str(tiny_data_dir), objective="mlm", preset="bert-tiny", batch_size=8,
                            max_iters=20, warmup_iters=2, eval_interval=20, eval_batches=1,
                            out_dir=str(tmp_path / "mlm"), device="cpu", seed=0))
    data = keyword_task(tmp_path / "sst2")
    result = glue.main([f"--ckpt={tmp_path / 'mlm' / 'ckpt.safetensors'}", "--task=sst2", f"--data={data}",
                        "--epochs=2", "--batch_size=16", "--lr=2e-3", f"--json={tmp_path / 'r.json'}",
                        "--device=cpu"])
    assert result["accuracy"] > 0.85 and result["score"] == result["accuracy"]  # chance is 0.5
    assert json.loads((tmp_path / "r.json").read_text())["accuracy"] == result["accuracy"]
    assert not result["causal_checkpoint"] and "warning" not in capsys.readouterr().err


def test_regression_head_and_causal_checkpoint_warning(tmp_path, capsys):
    torch.manual_seed(0)
    decoder = GPT(GPTConfig(vocab_size=50304, block_size=32, n_layer=1, n_head=2, d_model=32))
    save_checkpoint(tmp_path / "dec.pt", {"model": decoder.state_dict(), "data_meta": {"tokenizer": "gpt2"},
                                          "model_config": dataclasses.asdict(decoder.config)})
    folder = tmp_path / "stsb"
    folder.mkdir()
    rng = random.Random(1)
    for split, n in (("train", 64), ("validation", 32)):
        rows = [{"sentence1": "a b c", "sentence2": w, "label": {"yes": 5.0, "maybe": 2.0, "no": 0.0}[w]}
                for w in (rng.choice(["yes", "maybe", "no"]) for _ in range(n))]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = glue.main([f"--ckpt={tmp_path / 'dec.pt'}", "--task=stsb", f"--data={folder}", "--epochs=8",
                        "--batch_size=8", "--lr=3e-3", "--device=cpu"])
    assert result["causal_checkpoint"] and "warning" in capsys.readouterr().err
    assert result["pearson"] > 0.7 and result["spearman"] > 0.9  # chance: 0


@pytest.mark.parametrize("flags, message", [
    (["--lr=inf"], "--lr must be a finite number, got inf"),
    (["--weight_decay=-1"], "--weight_decay must be >= 0, got -1.0"),
    (["--json=OUT"], "is a directory"),
])
def test_bad_numbers_are_refused_before_any_work(flags, message, tmp_path):
    refused_before_any_work(glue.main, ["--ckpt=CKPT", *flags], message, tmp_path)


# ------------------------------------------------------------- issue 33: contracts 1, 4 (line formats), 6


def tiny_encoder(path):
    torch.manual_seed(0)
    encoder = GPT(GPTConfig(vocab_size=50304, block_size=32, n_layer=1, n_head=2, d_model=32, causal=False))
    save_checkpoint(path, {"model": encoder.state_dict(), "data_meta": {"tokenizer": "gpt2"},
                           "model_config": dataclasses.asdict(encoder.config)})
    return path


def glue_folder(folder, train_row='{"sentence": "a fine film", "label": 1}\n'):
    folder.mkdir()
    (folder / "train.jsonl").write_text(train_row)
    (folder / "validation.jsonl").write_text('{"sentence": "a dull film", "label": 0}\n')
    return folder


def sparse_train(folder):
    glue_folder(folder)
    with open(folder / "train.jsonl", "wb") as f:
        f.truncate(3 << 30)  # 3 GB, no newline: one line, which used to be read whole until memory ran out
    return folder


SURROGATE_ROW = '"sentence": "a \\udc00 film", "label": 1}\n'  # JSON's \udc00: half a pair


GLUE_CASES = {  # case: (flags given tmp_path; what the one line says)
    "--json= its own train.jsonl": (lambda t: [f"--data={glue_folder(t / 'g')}", f"--json={t / 'g' / 'train.jsonl'}"],
                                    "--json={t}/g/train.jsonl lies inside --data={t}/g, an input of this command"),
    "a sparse 3 GB train.jsonl with no newline": (lambda t: [f"--data={sparse_train(t / 'g')}"],
                                                   "{t}/g/train.jsonl line 1 is longer than 1,048,576 bytes"),
    "a lone surrogate in a sentence": (
        lambda t: [f"--data={glue_folder(t / 'g', chr(123) + SURROGATE_ROW)}"],
        "{t}/g/train.jsonl line 1 holds a lone surrogate"),
    "--epochs=1e9": (lambda t: [f"--data={glue_folder(t / 'g')}", "--epochs=1e9"],
                     "--epochs must be in [1, 1048576], got 1000000000"),
    "--seed=-1": (lambda t: [f"--data={glue_folder(t / 'g')}", "--seed=-1"], "--seed must be in [0, 4294967295]"),
}


@pytest.mark.parametrize("case", GLUE_CASES)
def test_glue_refuses_each_case_in_one_line_and_changes_nothing(case, tmp_path, monkeypatch, capsys):
    ckpt = tiny_encoder(tmp_path / "enc.pt")
    flags, words = GLUE_CASES[case]
    argv = [f"--ckpt={ckpt}", "--task=sst2", "--device=cpu", *flags(tmp_path)]
    before = tree_state(tmp_path)
    err = refusal(glue.main, argv, monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words.format(t=tmp_path) in err, err


def test_glue_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): --json against --data (a folder) and --ckpt."""
    io_pairs({"glue --data": (glue.main, "folder", ("same", "inside", "holds", "link", "link_parent"), "r.json",
                              lambda i, o: ["--task=rte", f"--data={i}", f"--json={o}"]),
              "glue --ckpt": (glue.main, "file", ("same", "link", "link_parent", "hardlink"), "r.json",
                              lambda i, o: ["--task=rte", f"--ckpt={i}", f"--json={o}"])})(
        tmp_path_factory, monkeypatch, capsys)

"""xnli.py: the per-language score against hand-computed values, offline end-to-end runs on made-up
languages (zero-shot from English and each language in turn), and one-line errors."""
import dataclasses
import json
import random
import sys
import types

import numpy as np
import pytest
import torch
from helpers import io_pairs, read_ckpt, refusal, save_ckpt, tree_state

import xnli
from common import UserError
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model: extra threads are pure overhead


def test_accuracy_per_language_and_unweighted_average():
    pred = {"en": np.array([0, 1, 2, 2]), "fr": np.array([1, 1]), "sw": np.array([2, 0, 1])}
    gold = {"en": np.array([0, 1, 2, 0]), "fr": np.array([0, 1]), "sw": np.array([0, 1, 2])}
    accuracy, average = xnli.xnli_scores(pred, gold)
    assert accuracy == {"en": 3 / 4, "fr": 1 / 2, "sw": 0.0}
    # every language counts the same: (0.75 + 0.5 + 0) / 3, not the 5 / 9 pooled over the 9 examples
    assert average == pytest.approx(1.25 / 3)
    with pytest.raises(ValueError):
        xnli.xnli_scores({"en": pred["en"]}, gold)


# Made-up languages: filler words, and in the hypothesis one keyword that decides the label. `xx` shares
# English's keywords (so an English fine-tune transfers to it), `zz` shares nothing.
FILLER = {"en": ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with", "as", "his", "that",
                 "by"],
          "xx": ["bo", "ka", "mi", "ru", "te", "lo", "sa", "fu", "ne", "ri", "po", "zu", "ha", "ke", "ni", "mo"],
          "zz": ["qiv", "zep", "wux", "yom", "jad", "vok", "pim", "tuz", "hev", "gol", "ruf", "kiz", "baw", "dop",
                 "lun", "sef"]}
KEYWORDS = {"en": ("surely", "maybe", "never"), "xx": ("surely", "maybe", "never"),
            "zz": ("blorp", "snarf", "quix")}


def make_language(root, lang, n_train=96, n_test=60, seed=0):
    rng = random.Random(f"{lang}{seed}")
    folder = root / lang
    folder.mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for _ in range(n):
            label = rng.randrange(3)
            hypothesis = rng.sample(FILLER[lang], 3) + [KEYWORDS[lang][label]]
            rng.shuffle(hypothesis)
            rows.append({"premise": " ".join(rng.sample(FILLER[lang], 5)), "hypothesis": " ".join(hypothesis),
                         "label": label})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def encoder_ckpt(tmp_path_factory):
    """A tiny random bidirectional encoder, saved as train.py saves one."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=32, n_layer=1, n_head=2, d_model=32, causal=False))
    path = tmp_path_factory.mktemp("ckpt") / "enc.pt"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "gpt2"}}, path)
    return path


@pytest.fixture
def languages(tmp_path):
    for lang in FILLER:
        make_language(tmp_path / "xnli", lang)
    return tmp_path / "xnli"


FAST = ["--epochs=8", "--batch_size=16", "--lr=3e-3", "--warmup_fraction=0", "--device=cpu"]


def test_english_fine_tune_scores_every_language(encoder_ckpt, languages, tmp_path, capsys):
    out = tmp_path / "r.json"
    result = xnli.main([f"--ckpt={encoder_ckpt}", f"--data={languages}", f"--json={out}", *FAST])
    accuracy = result["accuracy"]
    assert list(accuracy) == ["en", "xx", "zz"] and result["setting"] == "zero-shot"
    assert accuracy["en"] > 0.8 and accuracy["xx"] > 0.6  # chance: 1/3; xx shares English's keywords
    assert result["average"] == pytest.approx(np.mean(list(accuracy.values())))
    assert list(result["train_loss"]) == ["en"] and result["test_examples"] == {"en": 60, "xx": 60, "zz": 60}
    saved = json.loads(out.read_text())
    assert saved["task"] == "xnli" and saved["train_lang"] == "en" and saved["accuracy"] == accuracy
    line = capsys.readouterr().out.strip()
    assert line.startswith("xnli (train en): en ") and line.endswith(f"average {100 * result['average']:.2f}")


def test_each_language_fine_tuned_and_scored_on_its_own_test_set(encoder_ckpt, languages):
    result = xnli.main([f"--ckpt={encoder_ckpt}", f"--data={languages}", "--train_lang=each",
                        "--langs=zz,xx", "--max_test_examples=40", *FAST])
    assert list(result["accuracy"]) == ["xx", "zz"] and list(result["train_loss"]) == ["xx", "zz"]
    assert min(result["accuracy"].values()) > 0.8 and result["setting"] == "target-language"
    assert result["test_examples"] == {"xx": 40, "zz": 40}
    assert result["average"] == pytest.approx(np.mean(list(result["accuracy"].values())))


def test_one_line_errors(encoder_ckpt, languages, tmp_path, monkeypatch):
    def run(*flags):
        with pytest.raises(UserError) as e:
            xnli.main([f"--ckpt={encoder_ckpt}", "--device=cpu", *flags])
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "unknown language 'fr'; known (the folders of" in run(f"--data={languages}", "--train_lang=fr")
    assert "en, xx, zz (or each)" in run(f"--data={languages}", "--train_lang=fr")
    assert "--langs: unknown language 'de'" in run(f"--data={languages}", "--langs=xx,de")
    assert "drop --langs" in run(f"--data={languages}", "--train_lang=xx", "--langs=xx")
    assert "--epochs must be in [1, 1048576], got 0" in run(f"--data={languages}", "--epochs=0")

    (languages / "zz" / "test.jsonl").unlink()
    assert run(f"--data={languages}").startswith(f"{languages / 'zz' / 'test.jsonl'} not found")
    only_xx = xnli.main([f"--ckpt={encoder_ckpt}", f"--data={languages}", "--train_lang=xx", "--epochs=1",
                         "--max_train_examples=8", "--device=cpu"])  # a run reads only the files it needs
    assert list(only_xx["accuracy"]) == ["xx"] and only_xx["average"] == only_xx["accuracy"]["xx"]
    (languages / "zz").rename(tmp_path / "spare")

    xx_train = languages / "xx" / "train.jsonl"
    lines = xx_train.read_text().splitlines()
    xx_train.write_text("\n".join([*lines[:2], "", json.dumps({**json.loads(lines[2]), "label": 3})]) + "\n")
    # line 4: the blank line 3 counts (xx's file is checked before en's fine-tune starts)
    message = run(f"--data={languages}", "--train_lang=each")
    assert message.startswith(f"{xx_train} line 4 has label 3, not 0, 1 or 2")
    xx_train.write_text(lines[0] + "\n" + '{"premise": "a", "label": 0}\n')
    assert "line 2 lacks hypothesis (has: premise, label)" in run(f"--data={languages}", "--train_lang=xx")
    xx_train.write_text('{"premise": 3, "hypothesis": "b", "label": 0}\n{oops\n')
    assert "line 1: premise must be text, got 3" in run(f"--data={languages}", "--train_lang=xx")
    xx_train.write_bytes(b'{"premise": "a", "hypothesis": "b", "label": 0}\n{oops\n')
    assert f"{xx_train} line 2 is not valid JSON" in run(f"--data={languages}", "--train_lang=xx")
    xx_train.write_bytes(b'\xff\xfe\n')
    assert f"{xx_train} line 1 is not UTF-8" in run(f"--data={languages}", "--train_lang=xx")

    failing = types.SimpleNamespace(logging=types.SimpleNamespace(set_verbosity=lambda level: None, CRITICAL=50),
                                    load_dataset=lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline")))
    monkeypatch.setitem(sys.modules, "datasets", failing)
    message = run("--langs=sw")
    assert message.startswith("could not load hf:facebook/xnli/sw test: offline; offline? pass --data=DIR")


@pytest.mark.parametrize("eot", [60000, -1, "5"])
def test_a_separator_outside_the_vocabulary_is_one_line(encoder_ckpt, languages, tmp_path, eot):
    ckpt = read_ckpt(encoder_ckpt)
    ckpt["data_meta"]["eot_token"] = eot
    save_ckpt(ckpt, tmp_path / "bad.pt")
    with pytest.raises(UserError, match=r"data_meta.eot_token (60000 is not a token id of the model's vocabulary|"
                                        r"is -1, outside|is '5', not int)"):  # the last two at the checkpoint's door
        xnli.main([f"--ckpt={tmp_path / 'bad.pt'}", f"--data={languages}", "--train_lang=xx", "--device=cpu"])


# ------------------------------------------------------------- issue 33: contracts 1, 4 (line formats), 6


def sparse_test(root):
    """A language whose test.jsonl is a sparse 3 GB file with no newline (one line, read whole before)."""
    make_language(root, "en")
    with open(root / "en" / "test.jsonl", "wb") as f:
        f.truncate(3 << 30)
    return root


def surrogate_test(root):
    make_language(root, "en")
    (root / "en" / "test.jsonl").write_text('{"premise": "a \\udc00", "hypothesis": "b", "label": 0}\n')
    return root


XNLI_CASES = {  # case: (flags given tmp_path; what the one line says)
    "--json= its own test.jsonl": (lambda t: make_language(t / "x", "en") and
                                   [f"--data={t / 'x'}", f"--json={t / 'x' / 'en' / 'test.jsonl'}"],
                                   "--json={t}/x/en/test.jsonl lies inside --data={t}/x, an input of this command"),
    "a sparse 3 GB test.jsonl with no newline": (lambda t: [f"--data={sparse_test(t / 'x')}"],
                                                 "{t}/x/en/test.jsonl line 1 is longer than 1,048,576 bytes"),
    "a lone surrogate in a premise": (lambda t: [f"--data={surrogate_test(t / 'x')}"],
                                      "{t}/x/en/test.jsonl line 1 holds a lone surrogate"),
    "--max_test_examples=1e20": (lambda t: [f"--data={t}", "--max_test_examples=1e20"],
                                 "--max_test_examples must be in [1, 1099511627776]"),
    "--seed=2**32": (lambda t: [f"--data={t}", "--seed=4294967296"], "--seed must be in [0, 4294967295]"),
}


@pytest.mark.parametrize("case", XNLI_CASES)
def test_xnli_refuses_each_case_in_one_line_and_changes_nothing(case, encoder_ckpt, tmp_path, monkeypatch, capsys):
    flags, words = XNLI_CASES[case]
    argv = [f"--ckpt={encoder_ckpt}", "--langs=en", "--device=cpu", *flags(tmp_path)]
    before = tree_state(tmp_path)
    err = refusal(xnli.main, argv, monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words.format(t=tmp_path) in err, err


def test_xnli_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): --json against --data (a folder) and --ckpt."""
    io_pairs({"xnli --data": (xnli.main, "folder", ("same", "inside", "holds", "link", "link_parent"), "r.json",
                              lambda i, o: [f"--data={i}", f"--json={o}"]),
              "xnli --ckpt": (xnli.main, "file", ("same", "link", "link_parent", "hardlink"), "r.json",
                              lambda i, o: [f"--ckpt={i}", f"--json={o}"])})(tmp_path_factory, monkeypatch, capsys)

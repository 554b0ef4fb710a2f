"""eval.py: the lambada_openai definition against an independent plain loop, batching, the command line."""
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_work
from helpers import io_pairs, read_ckpt, read_log, refusal, save_ckpt, tiny_config, tree_state
from hypothesis import given, settings, strategies as st

import eval as evaluation
import train
from common import UserError
from data import open_split
from loss import LossConfig, contrastive_table
from model import GPT, GPTConfig
from tokenizer import load_tokenizer
from train import Objective, Validation, ValSplit, evaluate

ROOT = Path(__file__).resolve().parents[1]


class ToyTokenizer:
    """GPT-2-like in miniature: " " is 0, letters a-g are 1-7, a space and a letter (" a".." g") make
    one token 8-14, 15 is end-of-text. So the target " cab" is three tokens: " c", "a", "b"."""
    letters = "abcdefg"
    eot_token = 15

    def encode(self, text, **_):
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and text[i + 1:i + 2] and text[i + 1] in self.letters:
                ids.append(8 + self.letters.index(text[i + 1]))
                i += 2
            else:
                ids.append(0 if text[i] == " " else 1 + self.letters.index(text[i]))
                i += 1
        return ids


def tiny_model(vocab_size=16, lm_head=False, seed=0, std=0.5, **overrides) -> GPT:
    """Random weights; a large init spread makes predictions vary (std 0.02 mostly echoes the input)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab_size, block_size=24, n_layer=2, n_head=2, d_model=32, lm_head=lm_head)
    model = GPT(GPTConfig(**{**config, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model.eval()


@torch.no_grad()
def reference(model, tok, texts):
    """The harness's definition written out plainly, one example at a time: (acc, ppl, lls, hits)."""
    window = model.config.block_size
    lls, hits = [], []
    for text in texts:
        cut = text.rfind(" ")
        context = text[:cut].rstrip() if cut >= 0 else ""  # trailing spaces go to the target
        target = text[len(context):] if cut >= 0 else " " + text
        if context:
            context_ids = tok.encode(context)
            target_ids = tok.encode(context + target)[len(context_ids):]
        else:
            context_ids, target_ids = [tok.eot_token], tok.encode(target)
        inp = (context_ids + target_ids)[-(window + 1):][:-1]
        logp = torch.log_softmax(model(torch.tensor([inp]))[0].float(), dim=-1)
        ll, hit = 0.0, True
        for j, t in enumerate(target_ids):
            row = logp[len(inp) - len(target_ids) + j]
            ll += row[t].item()
            hit = hit and int(row.argmax()) == t
        lls.append(ll)
        hits.append(hit)
    return sum(hits) / len(hits), math.exp(-sum(lls) / len(lls)), lls, hits


@torch.no_grad()
def greedy_texts(model, tok, count, rng):
    """Texts whose last word is the model's own greedy continuation of a short random context."""
    def argmax_after(ids):
        return int(model(torch.tensor([ids]))[0, -1].argmax())

    texts = []
    for context in random_texts(2000, rng, words=(1, 3)):
        ids = tok.encode(context)
        first = argmax_after(ids)
        if not 8 <= first <= 14:  # the model must predict a word start (" x") first
            continue
        word = tok.letters[first - 8]
        while len(word) < 3 and 1 <= (t := argmax_after(ids + tok.encode(" " + word))) <= 7:
            word += tok.letters[t - 1]
        texts.append(f"{context} {word}")
        if len(texts) == count:
            return texts
    raise AssertionError("the model never predicted a word start")


def random_texts(count, rng, words=(1, 5)):
    return [" ".join("".join(rng.choice(list("abcdefg")) for _ in range(rng.randint(1, 5)))
                     for _ in range(rng.randint(*words))) for _ in range(count)]


def test_split_context_target():
    assert evaluation.split_context_target("He ate the cake") == ("He ate the", " cake")
    assert evaluation.split_context_target("cake") == ("", " cake")
    assert evaluation.split_context_target("a  b") == ("a ", " b")  # text.split(" ") keeps empty words
    assert evaluation.split_context_target("line one\nthe end.") == ("line one\nthe", " end.")


def test_encode_example_gpt2():
    tok = load_tokenizer("gpt2")
    assert evaluation.encode_example(tok, "The cat sat on the mat") == (tok.encode("The cat sat on the"),
                                                                      tok.encode(" mat"))
    context, target = evaluation.encode_example(tok, "said hello  world")  # the context's space moves over
    assert tok.decode(context) == "said hello" and tok.decode(target) == "  world"
    assert evaluation.encode_example(tok, "Hello") == ([50256], tok.encode(" Hello"))  # no context: EOT


@pytest.mark.parametrize("lm_head", [False, True])
def test_matches_independent_reference(lm_head):
    import random
    rng, tok = random.Random(lm_head), ToyTokenizer()
    model = tiny_model(lm_head=lm_head)
    window = model.config.block_size
    texts = greedy_texts(model, tok, 6, rng) + random_texts(12, rng) + random_texts(4, rng, words=(9, 12))
    texts += ["abc", "ab  cd", " ef", "  ga", "abc def "]  # no space, double space, leading spaces, trailing
    assert any(len(t) > window + 1 for t in texts)  # some contexts exceed the window
    acc, ppl, lls, hits = reference(model, tok, texts)
    assert 0 < acc < 1
    one = evaluation.score_lambada(model, tok, texts, batch_size=1)
    assert one["n"] == len(texts) and one["greedy"] == hits and one["acc"] == acc
    assert one["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert one["loglikelihoods"] == pytest.approx(lls, rel=1e-5, abs=1e-5)
    # Padding cannot move a score: same greedy verdicts, log-likelihoods equal up to fp32 rounding. Not
    # bitwise: CPU matmul kernels sum in an order that depends on the number of rows (about 1e-7 relative).
    for batch_size in (3, 16):
        batched = evaluation.score_lambada(model, tok, texts, batch_size=batch_size)
        assert batched["greedy"] == one["greedy"] and batched["acc"] == one["acc"]
        assert batched["loglikelihoods"] == pytest.approx(one["loglikelihoods"], rel=1e-5, abs=1e-6)
        assert batched["ppl"] == pytest.approx(one["ppl"], rel=1e-6)


def test_truncation_keeps_the_last_tokens():
    tok, model = ToyTokenizer(), tiny_model()
    window = model.config.block_size  # 24: the model reads the last 25 tokens, minus the final one
    long = "ab" + " abc" * 10 + " fed"  # 35 tokens: " abc" is " a", "b", "c"
    kept = "c" + " abc" * 7 + " fed"  # its last 25 tokens
    assert tok.encode(long)[-(window + 1):] == tok.encode(kept)
    a = evaluation.score_lambada(model, tok, [long])
    b = evaluation.score_lambada(model, tok, [kept])
    assert a["loglikelihoods"] == b["loglikelihoods"]
    one_fewer = evaluation.score_lambada(model, tok, [" abc" * 7 + " fed"])
    assert one_fewer["loglikelihoods"] != a["loglikelihoods"]


def test_any_model_returning_logits():
    """A model with only forward(idx) -> logits goes through model(idx) itself."""
    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, idx):
            return self.inner(idx)

    import random
    tok, model = ToyTokenizer(), tiny_model()
    texts = random_texts(10, random.Random(1))
    a = evaluation.score_lambada(model, tok, texts, batch_size=4)
    b = evaluation.score_lambada(LogitsOnly(model), tok, texts, batch_size=4)
    assert a["greedy"] == b["greedy"] and a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], rel=1e-5)


def save_checkpoint(model, path, train_config=None):
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "gpt2", "vocab_size": 50257},
                "train_config": train_config or {}}, path)
    return str(path)


GPT2_TEXTS = ["The cat sat on the mat", "She opened the door and said hello", "Goodbye",
              "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
              "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the"
              " season of Light, it was the season of Darkness"]


@pytest.mark.parametrize("lm_head", [False, True])
def test_cli_lambada_json(tmp_path, lm_head):
    model = tiny_model(vocab_size=50304, lm_head=lm_head, std=0.02, d_model=8, n_layer=1, n_head=1,
                       block_size=32)
    ckpt = save_checkpoint(model, tmp_path / "ckpt.safetensors")
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t, "domain": None}) + "\n" for t in GPT2_TEXTS) + "\n")
    out = tmp_path / "results" / "lambada.json"
    evaluation.main([f"--ckpt={ckpt}", f"--data={data}", f"--json={out}", "--batch_size=3", "--device=cpu"])
    result = json.loads(out.read_text())
    acc, ppl, _, _ = reference(model, load_tokenizer("gpt2"), GPT2_TEXTS)
    assert result["task"] == "lambada" and result["n"] == 4 and result["checkpoint"] == ckpt
    assert result["acc"] == acc and result["ppl"] == pytest.approx(ppl, rel=1e-5)
    assert result["tokens_per_s"] > 0 and result["examples_per_s"] > 0
    assert [p.name for p in out.parent.iterdir()] == ["lambada.json"]  # no temp file left behind
    evaluation.main([f"--ckpt={ckpt}", f"--data={data}", f"--json={out}", "--max_examples=2"])
    assert json.loads(out.read_text())["n"] == 2


def test_cli_val(tiny_data_dir, tmp_path):
    model = tiny_model(vocab_size=50304, std=0.02, d_model=16, n_layer=1, n_head=1, block_size=32)
    ckpt = save_checkpoint(model, tmp_path / "ckpt.safetensors", {"dataset": str(tiny_data_dir), "loss": "ce"})
    result = evaluation.main([f"--ckpt={ckpt}", "--task=val", "--max_batches=3", "--batch_size=4",
                              f"--data_root={tiny_data_dir.parent}"])
    tokens = open_split(tiny_data_dir, "val", 50304)
    expected = evaluate(Objective(model, LossConfig(loss="ce")), ValSplit(tokens),
                        Validation(batch_size=4, block_size=32, max_batches=3))
    assert result["task"] == "val" and result["n"] == 3 * 4 * 32
    assert (result["ppl"] == pytest.approx(expected["val_ppl"])
            and result["ce"] == pytest.approx(expected["val_ce"]))


def bad_inputs(tmp_path):
    ckpt = save_checkpoint(tiny_model(vocab_size=50304, d_model=8, n_layer=1, n_head=1), tmp_path / "ckpt.safetensors")
    files = {"no_text.jsonl": '{"text": "a b"}\n{"txt": "c d"}\n', "broken.jsonl": '{"text": "a b"\n',
             "empty.jsonl": "\n"}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    return ckpt, [
        ([f"--ckpt={tmp_path}/missing.pt"], "missing.pt not found"),
        ([f"--ckpt={ckpt}", f"--data={tmp_path}/missing.jsonl"], "missing.jsonl not found"),
        ([f"--ckpt={ckpt}", f"--data={tmp_path}/no_text.jsonl"], 'line 2 has no "text" field'),
        ([f"--ckpt={ckpt}", f"--data={tmp_path}/broken.jsonl"], "line 1 is not valid JSON"),
        ([f"--ckpt={ckpt}", f"--data={tmp_path}/empty.jsonl"], "holds no examples"),
        ([f"--ckpt={ckpt}", "--task=hellaswag"], "choose one of: lambada, val"),
        ([f"--ckpt={ckpt}", "--batch_size=0"], "--batch_size must be in [1, 1048576]"),
        ([f"--ckpt={ckpt}"], "pass --data=FILE.jsonl"),  # tests run offline: the hub is unreachable
    ]


def test_bad_inputs_raise_user_errors(tmp_path):
    _, cases = bad_inputs(tmp_path)
    for argv, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            evaluation.main(argv)


def test_bad_inputs_one_line_on_the_command_line(tmp_path):
    """As scripts: exit code 2 and a single `error: ...` line, no traceback (processes run in parallel)."""
    _, cases = bad_inputs(tmp_path)
    procs = [(subprocess.Popen([sys.executable, str(ROOT / "eval.py"), *argv], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE), message)
             for argv, message in [cases[0], cases[2]]]
    for proc, message in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr
        assert "Traceback" not in stderr and stdout == ""


def test_contrastive_metrics_score_against_the_objectives_own_table():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16, lm_head=True))
    assert contrastive_table(model, "ce") is None
    assert contrastive_table(model, "cwt") is model.wte.weight
    assert contrastive_table(model, "ce+cwt") is model.wte.weight  # CWT's term, not the CE head
    assert contrastive_table(model, "nce") is model.lm_head.weight
    assert contrastive_table(model, "ce", encoder=True) is model.lm_head.weight  # encoders always report them


def test_validation_builds_no_autograd_graph(tiny_data_dir):
    model = GPT(GPTConfig(vocab_size=50304, block_size=32, n_layer=1, n_head=2, d_model=16))
    seen = []
    hidden = model.hidden
    model.hidden = lambda x: seen.append(torch.is_grad_enabled()) or hidden(x)
    tokens = open_split(tiny_data_dir, "val", 50304)
    evaluate(Objective(model, LossConfig(loss="cwt")), ValSplit(tokens), Validation(batch_size=2, block_size=32,
                                                                                   max_batches=2))
    assert seen == [False, False]


@pytest.mark.usefixtures("small_tiny_preset")
def test_eval_val_matches_the_training_log_by_default(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=2, batch_size=4, eval_batches=3)
    train.train(cfg)
    logged = [r for r in read_log(tmp_path) if "val_cwt" in r][-1]
    result = evaluation.main([f"--ckpt={tmp_path / 'ckpt.safetensors'}", "--task=val", "--max_batches=3",
                              "--device=cpu", f"--data_root={tiny_data_dir.parent}"])
    assert result["batch_size"] == 4 and result["dtype"] == "float32"
    for key in ("val_ce", "val_cwt", "val_acc"):
        assert result[key] == pytest.approx(logged[key], rel=1e-6), key
    assert evaluation.EvalConfig().dtype == "float32"
    # a mixed run's checkpoint: each source is scored by name (here, the run's own dataset under another name)
    ckpt = read_ckpt(tmp_path / "ckpt.safetensors")
    ckpt["train_config"]["dataset"] = f"{tiny_data_dir},other"
    save_ckpt(ckpt, tmp_path / "mixed.pt")
    with pytest.raises(UserError, match="was trained on a mix .*; pass --dataset=NAME for one of its sources"):
        evaluation.main([f"--ckpt={tmp_path / 'mixed.pt'}", "--task=val", "--device=cpu"])
    one = evaluation.main([f"--ckpt={tmp_path / 'mixed.pt'}", "--task=val", "--max_batches=3", "--device=cpu",
                           f"--dataset={tiny_data_dir}"])
    assert one["val_ce"] == pytest.approx(result["val_ce"], rel=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--ckpt=CKPT", "--batch_size=0"], "--batch_size must be in [1, 1048576], got 0"),
    (["--ckpt=CKPT", "--json=OUT"], "is a directory; pass a file path"),
])
def test_bad_numbers_are_refused_before_any_work(flags, message, tmp_path):
    refused_before_any_work(evaluation.main, flags, message, tmp_path)


def test_val_on_a_dataset_of_another_tokenizer_is_refused(tiny_data_dir, tmp_path):
    """bpe:512 ids scored as GPT-2's gave val_bpb 8.06 and exit 0; the tokenizers are compared first."""
    model = tiny_model(vocab_size=50304, d_model=8, n_layer=1, n_head=1, block_size=32)
    ckpt = tmp_path / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "bpe:512", "tokenizer_sha256": "0" * 64, "vocab_size": 512},
                "train_config": {"dataset": "elsewhere"}}, ckpt)
    with pytest.raises(UserError, match=f"trained with tokenizer 'bpe:512' but {tiny_data_dir} uses 'gpt2'"):
        evaluation.main([f"--ckpt={ckpt}", "--task=val", f"--dataset={tiny_data_dir}", "--max_batches=1"])


@settings(max_examples=8, deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 1e3, 1e30, math.inf, math.nan]), task=st.sampled_from(["val", "lambada"]))
def test_every_metric_printed_or_written_is_finite_or_the_command_fails(tiny_data_dir, scale, task):
    """NaN, infinite or overflowing weights (1e30) printed `val_ce nan` and wrote a bare NaN into --json."""
    out = Path(tempfile.mkdtemp())
    model = tiny_model(vocab_size=50304, d_model=8, n_layer=1, n_head=1, block_size=32)
    with torch.no_grad():
        model.wte.weight.mul_(scale)
    ckpt = save_checkpoint(model, out / "ckpt.safetensors", {"dataset": str(tiny_data_dir), "loss": "ce"})
    (out / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in GPT2_TEXTS[:2]))
    of_task = {"val": ["--max_batches=1", f"--data_root={tiny_data_dir.parent}"],  # each task's own settings only
               "lambada": [f"--data={out / 'lambada.jsonl'}"]}[task]
    flags = [f"--ckpt={ckpt}", f"--task={task}", *of_task, f"--json={out / 'result.json'}", "--device=cpu"]
    try:
        result = evaluation.main(flags)
    except UserError as e:
        assert "not a finite number" in str(e) and "\n" not in str(e)
        assert not (out / "result.json").exists()
        return
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float))
    assert json.loads((out / "result.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == result


def test_lambada_from_an_unreachable_hub_is_one_line_at_once(monkeypatch):
    """Offline, the default task checks the hub with one quiet connection and stops with the way out (--data, or
    HF_HUB_OFFLINE=1 for a cached copy) before the datasets library, which would retry for most of a minute;
    with HF_HUB_OFFLINE=1 it tries no connection and reads the cache."""
    import socket

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    tried = []

    def unreachable(address, *args, **kwargs):
        tried.append(address)
        raise OSError("network unreachable (the test)")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it would fail the test's match below
    with pytest.raises(UserError, match=r"^cannot reach the Hugging Face hub \(https://huggingface.co\) to load "
                                        r"EleutherAI/lambada_openai: pass --data=FILE.jsonl .*HF_HUB_OFFLINE=1") as e:
        evaluation.load_lambada(None)
    assert tried == [("huggingface.co", 443)] and "\n" not in str(e.value)
    with pytest.raises(UserError, match="^cannot reach the Hugging Face hub"):  # before reading the checkpoint
        evaluation.main(["--ckpt=no-such/ckpt.safetensors"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="could not load EleutherAI/lambada_openai"):  # the cache: here, none
        evaluation.load_lambada(None)
    assert len(tried) == 2


# ------------------------------------------------------------- issue 33: contracts 1, 4 (line formats), 5, 6


def sparse_line(path: Path) -> str:
    """A sparse 3 GB file with no newline: one line, which used to be read whole until memory ran out."""
    with open(path, "wb") as f:
        f.truncate(3 << 30)
    return str(path)


def hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "gpt_neox"}\n')
    return path


EVAL_CASES = {  # case: (flags given tmp_path, the checkpoint, the test dataset; what the one line says)
    "--json= the dataset's meta.json": (
        lambda t, c, d: [f"--ckpt={c}", "--task=val", f"--dataset={d}", f"--json={d / 'meta.json'}"],
        "--json={d}/meta.json lies inside --dataset={d}, an input of this command"),
    "--json= a tokenizer.json in the dataset the checkpoint names": (
        lambda t, c, d: [f"--ckpt={c}", "--task=val", f"--data_root={d.parent}", f"--json={d / 'tokenizer.json'}"],
        "--json={d}/tokenizer.json lies inside --dataset={d}, an input of this command"),
    "--json= the --config file": (
        lambda t, c, d: (t / "cfg.json").write_text('{"device": "cpu"}') and
        [f"--ckpt={c}", f"--config={t / 'cfg.json'}", f"--json={t / 'cfg.json'}"],
        "--json={t}/cfg.json is also an input of this command (--config={t}/cfg.json)"),
    "--json= an hf: folder's config.json": (
        lambda t, c, d: [f"--ckpt=hf:{hf_folder(t / 'hfm')}", f"--json={t / 'hfm' / 'config.json'}"],
        "--json={t}/hfm/config.json lies inside --ckpt={t}/hfm, an input of this command"),
    "a sparse 3 GB --data file with no newline": (
        lambda t, c, d: [f"--ckpt={c}", f"--data={sparse_line(t / 'big.jsonl')}"],
        "{t}/big.jsonl line 1 is longer than 1,048,576 bytes"),
    "a lone surrogate in a text": (
        lambda t, c, d: (t / "s.jsonl").write_text('{"text": "the cat \\ud800 sat"}\n') and
        [f"--ckpt={c}", f"--data={t / 's.jsonl'}"], "{t}/s.jsonl line 1 holds a lone surrogate"),
    "--max_batches with --task=lambada": (lambda t, c, d: [f"--ckpt={c}", "--max_batches=5"],
                                          "--max_batches=5 changes nothing with --task=lambada"),
    "--data with --task=val": (lambda t, c, d: [f"--ckpt={c}", "--task=val", f"--data={t / 'x.jsonl'}"],
                               "changes nothing with --task=val"),
    "--batch_size=1e9": (lambda t, c, d: [f"--ckpt={c}", "--batch_size=1e9"],
                         "--batch_size must be in [1, 1048576], got 1000000000"),
    "a --json name too long for the file system": (lambda t, c, d: [f"--ckpt={c}", f"--json={t / ('j' * 300)}"],
                                                   "is too long for a file system: a name of 300 bytes"),
}


@pytest.mark.parametrize("case", EVAL_CASES)
def test_eval_refuses_each_case_in_one_line_and_changes_nothing(case, tiny_data_dir, tmp_path, monkeypatch,
                                                                capsys):
    ckpt = save_checkpoint(tiny_model(vocab_size=50304, d_model=8, n_layer=1, n_head=1), tmp_path / "ckpt.safetensors",
                           {"dataset": str(tiny_data_dir), "loss": "ce"})
    flags, words = EVAL_CASES[case]
    argv = [*flags(tmp_path, ckpt, tiny_data_dir), "--device=cpu"]
    before = tree_state(tmp_path), tree_state(tiny_data_dir)
    err = refusal(evaluation.main, argv, monkeypatch, capsys)
    assert (tree_state(tmp_path), tree_state(tiny_data_dir)) == before
    assert words.format(t=tmp_path, d=tiny_data_dir) in err, err


EVAL_IO = {  # script: (main, its input's kind, the relations that apply, the name of what it writes, argv)
    "eval --ckpt": (evaluation.main, "file", ("same", "link", "link_parent", "hardlink"), "r.json",
                    lambda i, o: [f"--ckpt={i}", f"--json={o}"]),
    "eval --data": (evaluation.main, "jsonl", ("same", "link", "link_parent", "hardlink"), "r.json",
                    lambda i, o: [f"--ckpt={i}.pt", f"--data={i}", f"--json={o}"]),
    "eval --config": (evaluation.main, "config", ("same", "link", "link_parent", "hardlink"), "r.json",
                      lambda i, o: [f"--config={i}", f"--json={o}"]),
    "eval --ckpt=hf:": (evaluation.main, "hf", ("same", "inside", "holds", "link", "link_parent"), "r.json",
                        lambda i, o: [f"--ckpt=hf:{i}", f"--json={o}"]),
}


def test_eval_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): eval.py's --json against each input it reads."""
    io_pairs(EVAL_IO)(tmp_path_factory, monkeypatch, capsys)


def test_a_dataset_path_inside_a_checkpoint_is_never_opened(tiny_data_dir, tmp_path):
    """Issue 33: eval.py --task=val read the absolute dataset path a checkpoint records. A checkpoint never decides
    where data is read: its dataset is looked for by its folder's name under --data_root."""
    elsewhere = Path(shutil.copytree(tiny_data_dir, tmp_path / "elsewhere" / "books"))
    model = tiny_model(vocab_size=50304, d_model=8, n_layer=1, n_head=1, block_size=32)
    ckpt = save_checkpoint(model, tmp_path / "ckpt.safetensors", {"dataset": str(elsewhere), "loss": "ce"})
    with pytest.raises(UserError) as e:
        evaluation.main([f"--ckpt={ckpt}", "--task=val", "--max_batches=1", f"--data_root={tmp_path / 'data'}"])
    assert f"looked for as {tmp_path / 'data' / 'books'}" in str(e.value) and "never opened" in str(e.value)
    assert "\n" not in str(e.value)
    shutil.copytree(tiny_data_dir, tmp_path / "data" / "books")  # the same dataset, under this command's root
    result = evaluation.main([f"--ckpt={ckpt}", "--task=val", "--max_batches=1", f"--data_root={tmp_path / 'data'}"])
    assert result["dataset"] == str(tmp_path / "data" / "books")


@pytest.mark.parametrize("spec, words", [(None, "lacks mask_spec"),
                                         ({"mask_token": 5, "vocab_size": 64, "special_tokens": (0,), "x": 1},
                                          "mask_spec.x is not a field of this code's")])
def test_an_encoders_damaged_mask_spec_is_one_line(spec, words, tmp_path):
    """Issue 33: eval.py --task=val on an encoder whose mask_spec was null or held an unknown key raised TypeError
    (MaskSpec(**spec)) with a traceback; the checkpoint's door refuses it."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16, causal=False))
    path = tmp_path / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "mask_spec": spec,
                "data_meta": {"tokenizer": "gpt2"}, "train_config": {"objective": "mlm", "dataset": "x"}}, path)
    with pytest.raises(UserError) as e:
        evaluation.main([f"--ckpt={path}", "--task=val", f"--data_root={tmp_path}"])
    assert words in str(e.value) and "\n" not in str(e.value)

"""generate.py: KV-cache equivalence, top-k/top-p filtering, streaming, and the command line."""
import dataclasses
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import refusal, save_ckpt

from common import run_main
from generate import filter_logits, generate, main, sample_token, stream_text
from model import build_model
from tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
INF = float("-inf")



@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny", 256, block_size=64, d_model=32, n_head=4, n_layer=2).eval()


def prompt(n, seed=1):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize("n_prompt, n_new", [(1, 63), (5, 59), (40, 24), (64, 1)])
def test_greedy_with_cache_equals_without_token_for_token(model, n_prompt, n_new):
    # prompt + generation fills the 64-token window exactly: the last token is predicted from 63 + 1
    ids = prompt(n_prompt)
    cached = list(generate(model, ids, n_new, temperature=0, use_cache=True))
    uncached = list(generate(model, ids, n_new, temperature=0, use_cache=False))
    assert len(cached) == n_new
    assert cached == uncached


def record_lengths(model, monkeypatch):
    lengths = []
    hidden = model.hidden

    def spy(idx, cache=None):
        lengths.append(idx.size(1))
        return hidden(idx, cache)

    monkeypatch.setattr(model, "hidden", spy)
    return lengths


def test_cache_reads_one_position_per_token_and_reprefills_half_a_window(model, monkeypatch):
    lengths = record_lengths(model, monkeypatch)
    assert len(list(generate(model, prompt(10), 100, temperature=0, use_cache=True))) == 100
    # prefill 10, then 1 each until the 64-slot cache is full, then rebuild from the last 32 tokens
    assert lengths == [10] + [1] * 54 + [32] + [1] * 32 + [32] + [1] * 11


def test_without_cache_the_context_slides_over_the_last_block(model, monkeypatch):
    lengths = record_lengths(model, monkeypatch)
    assert len(list(generate(model, prompt(10), 100, temperature=0, use_cache=False))) == 100
    assert lengths == list(range(10, 64)) + [64] * 46


def test_prompt_longer_than_the_window_is_cropped_both_ways(model):
    ids = prompt(80)
    assert list(generate(model, ids, 3, temperature=0)) == list(generate(model, ids, 3, temperature=0,
                                                                          use_cache=False))


def test_the_cache_holds_what_the_run_needs_not_the_whole_context(monkeypatch):
    # an imported config may claim a context of 2^20 tokens: 12 positions must not allocate a cache that long
    import generate as generate_module

    torch.manual_seed(0)
    wide = build_model("tiny", 256, block_size=1 << 16, d_model=32, n_head=4, n_layer=2).eval()
    made, real = [], generate_module.KVCache
    monkeypatch.setattr(generate_module, "KVCache", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    ids = prompt(5)
    assert list(generate(wide, ids, 7, temperature=0)) == list(generate(wide, ids, 7, temperature=0,
                                                                        use_cache=False))
    assert [cache.k.size(3) for cache in made] == [12]


# ----------------------------------------------------------------------------------------------
# Sampling


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, -1.0])
    assert filter_logits(logits, top_k=2).tolist() == [INF, 3.0, 2.0, INF, INF]
    assert filter_logits(logits, top_k=0).tolist() == logits.tolist()  # off
    assert filter_logits(logits, top_k=9).tolist() == logits.tolist()  # more than the vocabulary


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    logits = torch.tensor([math.log(p) for p in probs])[[3, 0, 4, 2, 1]]  # shuffled: 0.1 0.5 0.05 0.15 0.2
    def kept(**kw):
        return (filter_logits(logits, **kw) > INF).tolist()
    assert kept(top_p=0.3) == [False, True, False, False, False]  # 0.5 alone reaches 0.3
    assert kept(top_p=0.6) == [False, True, False, False, True]  # 0.5 + 0.2
    assert kept(top_p=0.8) == [False, True, False, True, True]  # 0.5 + 0.2 + 0.15 = 0.85
    assert kept(top_p=1.0) == [True] * 5
    assert kept(top_p=1e-9) == [False, True, False, False, False]  # the top token always survives
    # top-k first, then nucleus on the renormalised rest: 0.5/0.85 = 0.59, + 0.2/0.85 = 0.82 >= 0.8
    assert kept(top_k=3, top_p=0.8) == [False, True, False, False, True]
    kept_rows = filter_logits(torch.stack([logits, logits.flip(0)]), top_p=0.6) > INF  # batched (..., V)
    assert kept_rows.tolist() == [[False, True, False, False, True], [True, False, False, True, False]]


def test_sampling_respects_filters_seed_and_temperature_zero():
    logits = torch.tensor([0.0, 2.0, 1.0, 1.9, -3.0])
    draws = {sample_token(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s))
             for s in range(50)}
    assert draws == {1, 3}
    assert sample_token(logits, 0.0, top_k=3) == 1  # greedy
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample_token(logits, 2.0, generator=g1) for _ in range(20)] == \
           [sample_token(logits, 2.0, generator=g2) for _ in range(20)]


def test_generate_stops_at_end_of_text_and_stays_in_the_tokenizer_vocabulary(model):
    ids = prompt(5)
    first = next(generate(model, ids, 1, temperature=0))
    assert list(generate(model, ids, 10, temperature=0, eot_token=first)) == []
    out = list(generate(model, ids, 30, temperature=1.5, vocab_size=10,
                        generator=torch.Generator().manual_seed(0)))
    assert len(out) == 30 and max(out) < 10
    with pytest.raises(ValueError):
        next(generate(model, [], 5))


class Chunks(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks = []

    def write(self, s):
        self.chunks.append(s)
        return super().write(s)


def test_stream_never_prints_half_a_character():
    tok = load_tokenizer("gpt2")
    ids = tok.encode_ordinary("Bonjour ✓ héhé 日本語 🙂!")
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens are partial characters
    out = Chunks()
    assert stream_text(tok, ids[:2], iter(ids[2:]), out) == len(ids) - 2
    assert out.getvalue() == tok.decode(ids) + "\n"
    assert not any("\ufffd" in c for c in out.chunks)


# ----------------------------------------------------------------------------------------------
# Command line


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    m = build_model("tiny", 50304, d_model=32, n_layer=1, n_head=2, block_size=64)
    path = tmp_path_factory.mktemp("gen") / "ckpt.safetensors"
    save_ckpt({"model": m.state_dict(), "model_config": dataclasses.asdict(m.config),
                "data_meta": {"tokenizer": "gpt2", "vocab_size": 50257},
                "train_config": {"loss": "cwt"}}, path)
    return str(path)


BAD = {
    "missing checkpoint": ["--ckpt=does/not/exist.pt", "--prompt=Hi"],
    "empty prompt": ["--prompt="],
    "no prompt": [],
    "prompt too long": ["--prompt=" + "hello " * 70],
    "negative temperature": ["--prompt=Hi", "--temperature=-0.5"],
    "negative top_k": ["--prompt=Hi", "--top_k=-1"],
    "top_p zero": ["--prompt=Hi", "--top_p=0"],
    "top_p above one": ["--prompt=Hi", "--top_p=1.5"],
    "no new tokens": ["--prompt=Hi", "--max_new_tokens=0"],
    "no samples": ["--prompt=Hi", "--num_samples=0"],
    "missing prompt file": ["--prompt_file=nope.txt"],
    "unknown flag": ["--prompt=Hi", "--temprature=1"],
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_error(case, ckpt, monkeypatch, capsys):
    args = BAD[case] if case == "missing checkpoint" else [f"--ckpt={ckpt}", *BAD[case]]
    monkeypatch.setattr(sys, "argv", ["generate.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        run_main(main)  # exactly what `python generate.py` runs
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


GREEDY = ["--prompt=To be", "--prompt=Once upon", "--temperature=0", "--max_new_tokens=40"]


@pytest.fixture(scope="module")
def cli_runs(ckpt):
    """Real processes, started together (each pays ~2 s importing torch): the bad-input tests above run
    the same `run_main(main)` in-process, to keep the suite fast."""
    runs = {"greedy": [f"--ckpt={ckpt}", *GREEDY], "missing": ["--ckpt=nope.pt", "--prompt=a"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the processes share the cores
    procs = {k: subprocess.Popen([sys.executable, "generate.py", *a], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, a in runs.items()}
    results = {}
    for k, p in procs.items():
        out, err = p.communicate(timeout=120)
        results[k] = (p.returncode, out, err)
    return results


def test_cli_streams_greedy_text_identically_with_and_without_cache(cli_runs, ckpt, capsys):
    code, out, err = cli_runs["greedy"]
    assert code == 0, err
    assert out.startswith("---------- prompt 1/2, sample 1/1 ----------\nTo be")
    assert "\n---------- prompt 2/2, sample 1/1 ----------\nOnce upon" in out
    assert "raw headless checkpoint (--loss=cwt)" in err and "finetune.py" in err
    assert "tokens/s (kv cache" in err
    main([f"--ckpt={ckpt}", *GREEDY, "--kv_cache=false"])
    uncached = capsys.readouterr()
    assert uncached.out == out and "tokens/s (no cache" in uncached.err


def test_cli_bad_input_exits_2_with_one_line(cli_runs):
    code, out, err = cli_runs["missing"]
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


# ------------------------------------------------------------- issue 33: contracts 5, 6

GENERATE_CASES = {  # case: (flags; what the one line says)
    "a --prompt not in UTF-8 (bytes Python keeps as lone surrogates)": (
        [b"--prompt=caf\xe9".decode("utf-8", "surrogateescape")], "--prompt 1 is not UTF-8 text (caf\\udce9)"),
    "--top_k at temperature 0": (["--prompt=Hi", "--temperature=0", "--top_k=5"],
                                 "--top_k=5 changes nothing with --temperature=0"),
    "--seed at temperature 0": (["--prompt=Hi", "--temperature=0", "--seed=3"],
                                "--seed=3 changes nothing with --temperature=0"),
    "--max_new_tokens=1e12": (["--prompt=Hi", "--max_new_tokens=1e12"], "--max_new_tokens must be in [1, 16777216]"),
    "--num_samples=1e12": (["--prompt=Hi", "--num_samples=1e12"], "--num_samples must be in [1, 1048576]"),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_refuses_each_case_in_one_line(case, ckpt, monkeypatch, capsys):
    flags, words = GENERATE_CASES[case]
    assert words in refusal(main, [f"--ckpt={ckpt}", *flags], monkeypatch, capsys)

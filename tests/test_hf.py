"""The Hugging Face bridge: GPT-NeoX checkpoints in and out with equal logits, generations and tokens."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import read_ckpt, save_ckpt

import hf
import load
import train
from checkpoint import load_model
from common import UserError
from finetune import FinetuneConfig, finetune
from generate import generate
from model import GPT, GPTConfig
from tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("small_tiny_preset")

# LAMBADA-like text: quotes, punctuation, runs of spaces, newlines, non-ASCII, and the special token.
TEXTS = ["Hello world<|endoftext|>",
         "\u201cI don't know,\u201d she said.  He   replied: 'we'll see\u2014tomorrow.'\n\n"
         "The caf\u00e9's na\u00efve owner<|endoftext|>counted 1234567 coins.",
         " leading space, trailing spaces   ", "tabs\tand\r\nwindows lines \U0001F642 \u65e5\u672c\u8a9e",
         "<|endoftext|><|endoftext|>twice"]


def perturb_(model: torch.nn.Module, std: float = 0.1) -> None:
    """Non-trivial weights everywhere: LayerNorm gains away from 1, biases away from 0."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))


def random_neox(folder: Path, **overrides) -> transformers.GPTNeoXForCausalLM:
    settings = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=96, rotary_pct=0.25, rotary_emb_base=500, max_position_embeddings=32,
                    layer_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**{**settings, **overrides}))
    perturb_(model)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_import_gives_transformers_logits(tmp_path, parallel, tied):
    reference = random_neox(tmp_path, use_parallel_residual=parallel, tie_word_embeddings=tied)
    model, tokenizer = hf.load_hf(str(tmp_path))
    c = model.config
    assert tokenizer is None and c.parallel_residual == parallel and c.lm_head == (not tied)
    assert (c.rotary_dims, c.rope_base, c.mlp_hidden, c.block_size) == (4, 500.0, 96, 32)
    assert model.num_params() == reference.num_parameters()
    idx = torch.randint(0, 96, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx).logits, atol=1e-5, rtol=1e-5)


def test_a_sharded_folder_loads_as_the_whole_one(tmp_path):
    """model.safetensors.index.json and its shards, as transformers saves a large model, read through the same
    safetensors door; a shard the index names that is missing is one line."""
    reference = random_neox(tmp_path / "whole")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    whole, _ = hf.load_hf(str(tmp_path / "whole"))
    sharded, _ = hf.load_hf(str(tmp_path / "sharded"))
    assert all(torch.equal(t, whole.state_dict()[k]) for k, t in sharded.state_dict().items())
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(UserError, match=f"has no {shards[-1]}"):
        hf.load_hf(str(tmp_path / "sharded"))


@pytest.fixture(scope="module")
def checkpoints(tiny_data_dir, tmp_path_factory):
    """Briefly trained tiny NeoX checkpoints: raw CWT, CE (tied), and the CWT one fine-tuned with a head."""
    import model as model_module

    root = tmp_path_factory.mktemp("hf-ckpts")
    common = dict(dataset=str(tiny_data_dir), preset="tiny", block_size=32, batch_size=8, max_iters=3,
                  warmup_iters=1, lr=3e-3, eval_interval=3, eval_batches=1, device="cpu", seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model_module.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        for loss in ("cwt", "ce"):
            train.train(train.TrainConfig(**common, loss=loss, out_dir=str(root / loss)))
        ft = {**common, "max_iters": 2, "lr": 1e-3}
        finetune(FinetuneConfig(**ft, ckpt=str(root / "cwt/ckpt.safetensors"), out_dir=str(root / "ft")))
    return {name: root / name / "ckpt.safetensors" for name in ("cwt", "ce", "ft")}


@pytest.mark.parametrize("name", ["cwt", "ce", "ft"])
def test_export_loads_in_transformers_with_equal_logits_and_generations(checkpoints, tmp_path, name):
    ours = load_model(str(checkpoints[name]))
    assert (ours.lm_head is not None) == (name == "ft")
    out = hf.export(str(checkpoints[name]), str(tmp_path / "hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left behind
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] == (name != "ft")  # raw and CE models are scored with E
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "GPTNeoXForCausalLM" and theirs.dtype == torch.float32
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
        prompt = load_tokenizer("gpt2").encode_ordinary("ROMEO:\nWhat light through yonder")
        expected = list(generate(ours, prompt, 20, temperature=0, eot_token=50256))
        got = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              pad_token_id=50256)[0, len(prompt):].tolist()
    assert got[:len(expected)] == expected and len(expected) >= 1


def test_exported_tokenizer_encodes_like_tiktoken(checkpoints, tmp_path):
    out = hf.export(str(checkpoints["ce"]), str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    gpt2 = load_tokenizer("gpt2")
    assert theirs("Hello world<|endoftext|>")["input_ids"] == [15496, 995, 50256]
    assert theirs.eos_token_id == 50256
    for text in TEXTS:
        ids = gpt2.encode(text, allowed_special="all")
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == gpt2.decode(ids) == text
    # The same file through tokenizer.py's adapter: special tokens only where asked for, as tiktoken.
    adapter = load_tokenizer(str(out / "tokenizer.json"))
    assert (adapter.n_vocab, adapter.eot_token) == (50257, 50256)
    for text in TEXTS:
        assert adapter.encode(text, allowed_special="all") == gpt2.encode(text, allowed_special="all")
        assert adapter.encode_ordinary(text) == gpt2.encode_ordinary(text)
        assert adapter.decode(gpt2.encode_ordinary(text)) == text
    assert adapter.encode_ordinary_batch(TEXTS) == gpt2.encode_ordinary_batch(TEXTS)


def test_export_then_import_round_trips(checkpoints, tmp_path):
    ours = load_model(str(checkpoints["ft"]))
    out = hf.export(str(checkpoints["ft"]), str(tmp_path / "hf"))
    back, tokenizer = hf.load_hf(f"hf:{out}")
    assert tokenizer == "gpt2"  # GPT-2's BPE is recognised, so data prepared with gpt2 matches
    assert dataclasses.asdict(back.config) == {**dataclasses.asdict(ours.config)}
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_hf_sources_work_wherever_a_checkpoint_does(checkpoints, tiny_data_dir, tmp_path):
    """--init_from=hf:DIR continues an exported (or Pythia) model, and finetune.py fine-tunes one."""
    from data import open_split

    out = hf.export(str(checkpoints["cwt"]), str(tmp_path / "hf"))
    ckpt = load.load_source(f"hf:{out}", train.TrainConfig)
    assert ckpt.data_meta == {"tokenizer": "gpt2"} and ckpt.train_config == {"preset": "tiny"}
    ours = load_model(str(checkpoints["cwt"]))
    settings = dict(dataset=str(tiny_data_dir), block_size=32, batch_size=4, eval_batches=1, device="cpu")
    first = train.train(train.TrainConfig(**settings, init_from=f"hf:{out}", loss="cwt", max_iters=1,
                                          out_dir=str(tmp_path / "cont")))["first_val"]
    tokens = open_split(tiny_data_dir, "val")
    expected = train.evaluate(train.Objective(ours, train.LossConfig(loss="cwt")), train.ValSplit(tokens),
                              train.Validation(batch_size=4, block_size=32, max_batches=1))
    assert first["val_ce"] == pytest.approx(expected["val_ce"], rel=1e-5)  # the same model, before a step
    continued = read_ckpt(tmp_path / "cont" / "ckpt.safetensors")["train_config"]
    assert continued["preset"] == "tiny"  # the source model's shape, and so its recipe
    with pytest.raises(UserError, match="holds a tiny model; start from it with --preset=tiny"):
        train.train(train.TrainConfig(**settings, init_from=f"hf:{out}", preset="pythia-70m", max_iters=1,
                                      out_dir=str(tmp_path / "other")))
    tuned = finetune(FinetuneConfig(**settings, ckpt=f"hf:{out}", max_iters=1, out_dir=str(tmp_path / "ft")))
    assert tuned["step"] == 1 and load_model(str(tmp_path / "ft" / "ckpt.safetensors")).lm_head is not None


def test_architectures_without_a_transformers_class_are_refused(tmp_path):
    encoder = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16, causal=False)
    with pytest.raises(UserError, match="masked-LM encoder .* has no exact transformers"):
        hf.hf_config(encoder, 0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=16, norm="rmsnorm"))
    ckpt = tmp_path / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "gpt2"}}, ckpt)
    with pytest.raises(UserError, match="no exact transformers class"):
        hf.export(str(ckpt), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_no_bias_and_tanh_gelu_export_exactly(tmp_path):
    """Zero biases and transformers' gelu_pytorch_tanh are exact equivalents, so these export too."""
    model = GPT(GPTConfig(vocab_size=50304, block_size=16, n_layer=2, n_head=2, d_model=16, bias=False,
                          gelu="tanh", parallel_residual=False, rotary_pct=1.0, lm_head=True))
    perturb_(model)
    ckpt = tmp_path / "ckpt.safetensors"
    save_ckpt({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                "data_meta": {"tokenizer": "gpt2"}}, ckpt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf.export(str(ckpt), str(tmp_path / "hf")))
    idx = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model.eval()(idx), atol=1e-5, rtol=1e-5)


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_sources_get_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        hf.load_hf(str(tmp_path / "missing"))
    assert "not a folder" in one_line(e)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(UserError) as e:
        hf.load_hf(str(tmp_path))
    assert "llama" in one_line(e) and "gpt_neox" in one_line(e)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_act": "relu"}))
    with pytest.raises(UserError) as e:
        hf.load_hf(str(tmp_path))
    assert "relu" in one_line(e)
    with pytest.raises(UserError) as e:  # tests run with HF_HUB_OFFLINE=1
        hf.load_hf("hf:EleutherAI/no-such-model-offline")
    assert "hub" in one_line(e)
    with pytest.raises(UserError) as e:
        load_tokenizer("hf:EleutherAI/no-such-model-offline")
    assert "hub" in one_line(e)


def test_export_command_line(checkpoints, tmp_path, capsys):
    hf.main(["export", f"--ckpt={checkpoints['ce']}", f"--out={tmp_path / 'hf'}"])
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "from_pretrained" in capsys.readouterr().err
    with pytest.raises(UserError) as e:  # never over an existing export
        hf.main(["export", f"--ckpt={checkpoints['ce']}", f"--out={tmp_path / 'hf'}"])
    assert "not empty" in one_line(e)
    with pytest.raises(UserError, match="usage"):
        hf.main(["--ckpt=x"])


def test_a_model_with_non_finite_weights_is_not_exported(checkpoints, tmp_path):
    ckpt = read_ckpt(checkpoints["ce"])
    ckpt["model"]["blocks.0.mlp.up.weight"][0, 0] = float("nan")
    save_ckpt(ckpt, tmp_path / "nan.pt")
    with pytest.raises(UserError, match="weight blocks.0.mlp.up.weight is not finite") as e:
        hf.export(str(tmp_path / "nan.pt"), str(tmp_path / "hf"))
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def test_export_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): hf.py export's --out against --ckpt (a file, or an hf: folder)."""
    from helpers import io_pairs

    io_pairs({"export --ckpt": (hf.main, "file", ("same", "link", "link_parent", "hardlink"), "hf",
                                lambda i, o: ["export", f"--ckpt={i}", f"--out={o}"]),
              "export --ckpt=hf:": (hf.main, "hf", ("same", "inside", "holds", "link", "link_parent"), "hf",
                                    lambda i, o: ["export", f"--ckpt=hf:{i}", f"--out={o}"])})(
        tmp_path_factory, monkeypatch, capsys)

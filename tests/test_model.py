import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import save_ckpt

from checkpoint import load_model
from model import GPT, PRESETS, GPTConfig, KVCache, adamw, build_model, padded_vocab_size


def small_model(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=97, block_size=24, n_layer=2, n_head=2, d_model=16)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def test_shapes_and_tied_scoring():
    model = small_model()
    idx = torch.randint(0, 97, (3, 10))
    h = model.hidden(idx)
    assert h.shape == (3, 10, 16)
    logits = model(idx)
    assert logits.shape == (3, 10, 97)
    # No head: logits are dot products with the input embeddings (weight tying).
    torch.testing.assert_close(logits, h @ model.wte.weight.T)


def test_attention_is_causal():
    model = small_model()
    a = torch.randint(0, 97, (1, 12))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 1) % 97  # change only the future
    torch.testing.assert_close(model(a)[0, :7], model(b)[0, :7])
    assert not torch.allclose(model(a)[0, 7:], model(b)[0, 7:])


def test_added_lm_head_starts_as_a_copy_of_the_embeddings():
    model = small_model()
    idx = torch.randint(0, 97, (2, 8))
    before = model(idx)
    model.add_lm_head()
    assert model.lm_head is not None and model.config.lm_head
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()  # untied
    torch.testing.assert_close(model(idx), before)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not torch.allclose(model(idx), before)  # logits now come from the head


@pytest.mark.parametrize("chunks", [[10], [4, 1, 1, 4], [1] * 10, [7, 3]])
def test_kv_cache_matches_full_forward(chunks):
    model = small_model()
    idx = torch.randint(0, 97, (2, sum(chunks)))
    full = model(idx)
    cache = KVCache(model.config, batch_size=2, device="cpu")
    parts, start = [], 0
    for n in chunks:
        parts.append(model(idx[:, start:start + n], cache))
        start += n
    assert cache.pos == sum(chunks)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_context_longer_than_block_size_is_rejected():
    model = small_model()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_presets_have_the_papers_shapes():
    assert padded_vocab_size(50257) == 50304
    pythia = build_model("pythia-70m", 50304, lm_head=True)
    c = pythia.config
    assert (c.d_model, c.n_layer, c.n_head, c.block_size, c.mlp_width) == (512, 6, 8, 2048, 2048)
    assert (c.norm, c.norm_eps, c.bias, c.parallel_residual, c.gelu) == ("layernorm", 1e-5, True, True,
                                                                         "exact")
    assert (c.rotary_dims, c.rope_base) == (16, 10000.0)  # 25% of each 64-channel head
    # Pythia-70m's published counts (untied embed_in and embed_out)
    assert pythia.num_params() == 70_426_624
    assert pythia.num_params(embeddings=False) == 18_915_328
    c = build_model("pythia-160m", 50304).config
    assert ((c.d_model, c.n_layer, c.n_head, c.block_size, c.mlp_width, c.rotary_dims)
            == (768, 12, 12, 2048, 3072, 16))
    assert {"tiny", "pythia-70m", "pythia-160m", "gpt2-124m"} <= set(PRESETS)
    assert set(PRESETS) >= {"bert-tiny", "bert-small", "bert-base"}
    base = build_model("bert-base", 50304).config  # the paper's encoder: BERT-base's shape
    assert ((base.n_layer, base.d_model, base.n_head, base.mlp_width, base.block_size)
            == (12, 768, 12, 3072, 512))
    small = PRESETS["bert-small"]
    assert (small["n_layer"], small["d_model"], small["n_head"]) == (4, 512, 8)
    with pytest.raises(ValueError, match="unknown preset"):
        build_model("gpt5", 100)


def test_architecture_switches():
    idx = torch.randint(0, 97, (2, 10))
    base = small_model()
    with torch.no_grad():  # non-zero biases and norm shifts
        for p in base.parameters():
            p.add_(0.1 * torch.randn_like(p))
    # Partial rotary: only the first rotary_dims channels of each head see positions.
    assert base.config.rotary_dims == 2 and base.rope_cos.shape == (24, 1)
    variants = dict(norm="rmsnorm", parallel_residual=False, rotary_pct=1.0, gelu="tanh", bias=False)
    for name, value in variants.items():
        model = small_model(**{name: value})
        model.load_state_dict(base.state_dict(), strict=False)  # same weights where the shapes agree
        assert not torch.allclose(model(idx), base(idx)), name
    plain = small_model(**variants)
    assert all(not n.endswith("bias") for n, _ in plain.named_parameters())
    assert isinstance(plain.norm, torch.nn.RMSNorm) and isinstance(base.norm, torch.nn.LayerNorm)


def test_sequential_and_parallel_residual_blocks():
    """One block against its formula, written out by hand."""
    for parallel in (True, False):
        model = small_model(parallel_residual=parallel, n_layer=1)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        block, x = model.blocks[0], torch.randn(2, 10, 16)
        cos, sin = model.rope_cos[:10], model.rope_sin[:10]

        def attn(z, block=block, cos=cos, sin=sin):
            return block.attn(z, cos, sin)

        def mlp(z, block=block):
            return block.mlp.down(torch.nn.functional.gelu(block.mlp.up(z)))

        if parallel:
            expected = x + attn(block.norm1(x)) + mlp(block.norm2(x))
        else:
            y = x + attn(block.norm1(x))
            expected = y + mlp(block.norm2(y))
        torch.testing.assert_close(block(x, cos, sin), expected)


def test_flops_per_token_formula():
    model = small_model()
    n = model.num_params(embeddings=False)
    assert model.flops_per_token(24, 97) == 6 * n + 12 * 2 * 16 * 24 + 6 * 16 * 97


def test_weight_decay_groups():
    model = small_model(lm_head=True)
    opt = adamw(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()


def test_load_model_round_trip(tmp_path):
    model = small_model(lm_head=True)
    path = tmp_path / "ckpt.safetensors"
    # compiled models prefix their weights with _orig_mod.; load_model must accept both
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    save_ckpt({"model": state, "model_config": dataclasses.asdict(model.config)}, path)
    loaded = load_model(str(path))
    assert not loaded.training and loaded.lm_head is not None
    idx = torch.randint(0, 97, (1, 6))
    torch.testing.assert_close(loaded(idx), model(idx))
    save_ckpt({"weights": state}, path)
    with pytest.raises(ValueError, match="not a headless-lm checkpoint"):
        load_model(str(path))


@pytest.mark.parametrize("overrides", [dict(), dict(lm_head=True, parallel_residual=False, norm="rmsnorm", bias=False)])
def test_the_depth_scaled_init_follows_the_marker_and_gives_the_weights_of_before(overrides, monkeypatch):
    """Residual outputs are marked (model.residual_output), not found by a name suffix: at a fixed seed the
    weights are those of the old rule (zero biases, N(0, 0.02), "proj"/"down" weights shrunk with depth)."""
    import math

    from model import GPT, GPTConfig

    config = dict(vocab_size=96, block_size=16, n_layer=3, n_head=2, d_model=16, **overrides)
    torch.manual_seed(0)
    marked = GPT(GPTConfig(**config))
    torch.manual_seed(0)
    with monkeypatch.context() as mp:  # built without the init loop (it walks self.modules()): the old rule next
        mp.setattr(GPT, "modules", lambda self: iter(()))
        old = GPT(GPTConfig(**config))
    for name, p in old.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.dim() == 2:
            depth_scaled = name.endswith(("proj.weight", "down.weight"))
            torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * 3) if depth_scaled else 0.02)
    for (name, a), b in zip(marked.state_dict().items(), old.state_dict().values()):
        assert torch.equal(a, b), name
    assert {n for n, m in marked.named_modules() if getattr(m, "residual_output", False)} == \
        {f"blocks.{i}.{part}" for i in range(3) for part in ("attn.proj", "mlp.down")}



def test_state_shapes_are_a_built_models_with_no_memory_and_no_compiler():
    """What a checkpoint's weights are checked against (model.weights_problem): the shapes of a real build; a config
    whose rotary tables alone would take 256 GiB (a context of 2^20 at width 2^16) costs nothing (under a limit of
    8 GiB), and torch's compiler is not imported (its import made $TMPDIR/torchinductor_USER: issue 55), in a
    process of its own, as a command's."""
    import subprocess
    import sys

    configs = [GPTConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, block_size=16, **overrides) for overrides in
               ({}, dict(norm="rmsnorm", lm_head=True, bias=False), dict(rotary_pct=0.0, causal=False, mlp_hidden=24))]
    built = [{k: tuple(v.shape) for k, v in GPT(config).state_dict().items()} for config in configs]
    huge = GPTConfig(vocab_size=1, n_layer=1, n_head=1, d_model=1 << 16, block_size=1 << 20, rotary_pct=1.0)
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); import model; "
              "from model import GPTConfig; "
              f"print([model.state_shapes(c) for c in {configs!r}], len(model.state_shapes({huge!r})), "
              "'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.strip() == f"{built} 15 False", done.stderr[-2000:]

"""Masked-LM pre-training: BERT masking, bidirectional attention, losses over masked positions, resume."""
import json

import pytest
import torch
from helpers import read_ckpt

import model as model_module
import train
from common import UserError
from loss import LossConfig
from masking import NOT_MASKED, Masking, MaskSpec, mask_tokens
from model import GPT, GPTConfig, KVCache
from train import TrainConfig

EOT, MASK = 50256, 50257
SPEC = MaskSpec(mask_token=MASK, vocab_size=50257, special_tokens=(EOT,))


def test_masking_statistics_and_specials():
    x = torch.randint(0, EOT, (256, 128), generator=torch.Generator().manual_seed(0))
    x[:, ::8] = EOT  # 16 end-of-text tokens per row, 112 ordinary ones
    inputs, targets = mask_tokens(x, seed=1, index=5, spec=SPEC)
    chosen = targets != NOT_MASKED
    assert (chosen.sum(1) == round(0.15 * 128)).all()  # BERT's fixed count per window, specials counted
    assert not chosen[x == EOT].any() and (inputs[x == EOT] == EOT).all()  # specials never chosen
    assert torch.equal(targets[chosen], x[chosen]) and torch.equal(inputs[~chosen], x[~chosen])
    n = chosen.sum().item()
    to_mask = (inputs[chosen] == MASK).sum().item() / n
    unchanged = (inputs[chosen] == x[chosen]).sum().item() / n
    randomised = 1 - to_mask - unchanged
    assert abs(to_mask - 0.8) < 0.025 and abs(unchanged - 0.1) < 0.02 and abs(randomised - 0.1) < 0.02
    replaced = inputs[chosen & (inputs != MASK) & (inputs != x)]
    assert (replaced < EOT).all()  # random replacements are ordinary tokens, never EOT or [MASK]
    # every ordinary position is equally likely to be chosen (no positional bias)
    per_column = chosen[:, 1:8].float().mean(0)
    assert (per_column - 19 / 112).abs().max() < 0.07


def test_masking_is_a_pure_function_of_seed_and_index():
    x = torch.randint(0, EOT, (4, 64), generator=torch.Generator().manual_seed(1))
    a, b = mask_tokens(x, 3, 7, SPEC), mask_tokens(x.clone(), 3, 7, SPEC)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], mask_tokens(x, 3, 8, SPEC)[1])
    assert not torch.equal(a[1], mask_tokens(x, 4, 7, SPEC)[1])
    short = torch.full((3, 20), EOT)
    short[:, :2] = 7  # 2 ordinary tokens a window, short of its count of 3: both chosen, and one special
    chosen = mask_tokens(short, 0, 0, SPEC)[1] != NOT_MASKED
    assert (chosen.sum(1) == 3).all() and chosen[:, :2].all()


def tiny_model(causal: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, causal=causal)).eval()


@pytest.mark.parametrize("causal", [True, False])
def test_attention_is_bidirectional_only_for_an_encoder(causal):
    model = tiny_model(causal)
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 64  # a later token
    with torch.no_grad():
        before, after = model.hidden(x), model.hidden(changed)
    # earlier positions move only for an encoder
    assert torch.allclose(before[:, :-1], after[:, :-1]) == causal


def test_encoder_padding_mask_matches_unpadded_input():
    model = tiny_model(causal=False)
    x = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.arange(12)[None, :] < 7
    with torch.no_grad():
        assert torch.allclose(model.hidden(padded, pad_mask=mask)[:, :7], model.hidden(x), atol=1e-5)
        assert not torch.allclose(model.hidden(padded)[:, :7], model.hidden(x), atol=1e-5)


def test_an_encoder_has_no_kv_cache():
    with pytest.raises(ValueError, match="encoder"):
        KVCache(tiny_model(causal=False).config, 1, "cpu")


@pytest.mark.parametrize("loss", ["cwt", "ce"])
def test_mlm_loss_matches_float64_reference_over_masked_positions(loss):
    model = tiny_model(causal=False).double()
    x = torch.randint(0, 60, (3, 16), generator=torch.Generator().manual_seed(3))
    spec = MaskSpec(mask_token=60, vocab_size=60, special_tokens=(59,))
    inputs, targets = mask_tokens(x, 0, 0, spec)
    cfg = TrainConfig(objective="mlm", loss=loss)
    got = train.Objective(model, LossConfig.of(cfg), Masking(spec=spec))(inputs, targets, torch.Generator())
    with torch.no_grad():
        h, e = model.hidden(inputs).reshape(-1, 32), model.wte.weight
    rows = [i for i, t in enumerate(targets.flatten().tolist()) if t != NOT_MASKED]
    ids = targets.flatten()
    terms = []
    for i in rows:  # cwt: the original tokens of all masked positions are the candidates; ce: the vocabulary
        scores = [h[i] @ e[ids[j]] for j in rows] if loss == "cwt" else list(h[i] @ e.T)
        positive = h[i] @ e[ids[i]]
        terms.append(torch.logsumexp(torch.stack(scores), 0) - positive)
    assert len(rows) == sum(max(1, round(0.15 * 16)) for _ in range(3))
    torch.testing.assert_close(got.detach(), torch.stack(terms).mean(), rtol=1e-10, atol=1e-10)


@pytest.fixture
def small_encoder_preset(monkeypatch):
    small = dict(n_layer=2, n_head=2, d_model=64, block_size=32)
    monkeypatch.setitem(model_module.PRESETS, "bert-tiny", small)


def mlm_config(data_dir, out_dir, **overrides) -> TrainConfig:
    settings = dict(dataset=str(data_dir), objective="mlm", preset="bert-tiny", batch_size=8, max_iters=6,
                    warmup_iters=2, lr_schedule="constant", eval_interval=3, eval_batches=2, log_interval=1,
                    out_dir=str(out_dir), device="cpu", seed=0)
    return TrainConfig(**{**settings, **overrides})


def test_mlm_training_resumes_exactly_and_records_the_mask(tiny_data_dir, tmp_path, small_encoder_preset):
    straight = train.train(mlm_config(tiny_data_dir, tmp_path / "a"))
    assert set(straight["val"]) == {"val_ce", "val_ppl", "val_cwt", "val_acc"}
    train.train(mlm_config(tiny_data_dir, tmp_path / "b", max_iters=3))
    train.train(mlm_config(tiny_data_dir, tmp_path / "b", resume=True))
    def records(d):
        return map(json.loads, (d / "log.jsonl").read_text().splitlines())
    def losses(d):
        return {r["step"]: r["loss"] for r in records(d) if "loss" in r}
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # masks and batches depend on (seed, step) only
    ckpt = read_ckpt(tmp_path / "a" / "ckpt.safetensors")
    assert ckpt["mask_spec"] == {"mask_token": 50257, "vocab_size": 50257, "special_tokens": [50256]}  # JSON: a list
    assert ckpt["model_config"]["causal"] is False and ckpt["model_config"]["vocab_size"] == 50304
    with pytest.raises(UserError, match="encoder"):  # a decoder objective on an encoder: one line
        train.train(mlm_config(tiny_data_dir, tmp_path / "c", objective="causal",
                               init_from=str(tmp_path / "a" / "ckpt.safetensors")))


def test_scored_targets_come_without_hidden_states_and_a_short_window_is_never_scored_silently():
    from masking import masked_rows, scored_targets

    spec = MaskSpec(mask_token=50, vocab_size=50, special_tokens=(0,))
    tokens = torch.randint(1, 50, (3, 20), generator=torch.Generator().manual_seed(4))
    _, targets = mask_tokens(tokens, 0, 0, spec)
    h, rows = masked_rows(torch.randn(3, 20, 8), targets)
    assert torch.equal(scored_targets(targets), rows) and torch.equal(Masking(spec=spec).scored_targets(targets), rows)
    short = targets.clone()
    short[0, short[0] != NOT_MASKED] = NOT_MASKED  # a window that masks nothing: masked_rows would keep -100s
    with pytest.raises(RuntimeError, match="a window masks fewer positions than masked_count"):
        masked_rows(torch.randn(3, 20, 8), short)
    with pytest.raises(RuntimeError, match="a window masks fewer positions than masked_count"):
        scored_targets(short)


def test_the_checkpoint_door_reads_mask_spec_by_the_declaration_masking_uses():
    """MaskSpec is declared once, with the checkpoint that carries it (checkpoint.py, which the door reads, importing
    no extra): a spec masking builds passes the door's declared check, one with another field is refused."""
    import checkpoint
    import doors
    assert MaskSpec is checkpoint.MaskSpec
    spec = doors.plain(MaskSpec(mask_token=50, vocab_size=50, special_tokens=(49,)))
    assert doors.declared_problem(spec, MaskSpec) is None
    assert doors.declared_problem({**spec, "rate": 0.15}, MaskSpec) == "rate is not a field of this code's"

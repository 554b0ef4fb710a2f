"""negatives.py (not in the paper): unique, sampled and cross-rank negatives against explicit references."""
import math

import pytest
import torch
from test_loss import float64_by_default  # noqa: F401  (the fixture applies to this file too)

from loss import cwt_loss
from negatives import contrastive_loss, unique_candidates


def naive_cwt_unique(h, table, targets):
    """Candidates are the distinct target tokens: each token's embedding appears once."""
    distinct = sorted(set(targets.tolist()))
    total = 0.0
    for i in range(h.size(0)):
        scores = {t: float(h[i] @ table[t]) for t in distinct}
        total += -scores[int(targets[i])] + math.log(sum(math.exp(s) for s in scores.values()))
    return total / h.size(0)


def test_unique_negatives_drop_repeats_of_the_positive():
    table = torch.eye(3) * 50
    t = torch.tensor([0, 0, 1, 2])
    h = table[t].clone()
    assert contrastive_loss(h, table[t], targets=t, negatives="unique").item() == pytest.approx(0.0, abs=1e-6)


def test_unique_negatives_match_reference_and_gradients():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(5, 4, generator=g, requires_grad=True)
    t = torch.tensor([3, 1, 3, 0, 1, 1, 4])
    h = torch.randn(7, 4, generator=g, requires_grad=True)
    got = contrastive_loss(h, table[t], targets=t, negatives="unique")
    assert got.item() == pytest.approx(naive_cwt_unique(h.detach(), table.detach(), t), abs=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: contrastive_loss(a, b[t], targets=t, negatives="unique"), (h, table))


def test_unique_candidates_picks_each_token_once():
    t = torch.tensor([5, 2, 5, 9, 2])
    e = torch.arange(5.0)[:, None].repeat(1, 2)  # row i holds i, to see which rows were picked
    cand, labels = unique_candidates(e, t)
    assert cand[:, 0].tolist() == [1.0, 0.0, 3.0]  # first occurrences of tokens 2, 5, 9
    assert labels.tolist() == [1, 0, 1, 2, 0]


def naive_sampled(h, e, labels, drawn):
    total = 0.0
    for i in range(h.size(0)):
        candidates = [int(labels[i])] + [int(j) for j in drawn if int(j) != int(labels[i])]
        scores = [float(h[i] @ e[j]) for j in candidates]
        total += -scores[0] + math.log(sum(math.exp(s) for s in scores))
    return total / h.size(0)


@pytest.mark.parametrize("negatives", ["all", "unique"])
def test_subset_of_negatives_matches_reference(negatives):
    g = torch.Generator().manual_seed(5)
    table = torch.randn(6, 4, generator=g)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 2, 5])
    h = torch.randn(10, 4, generator=g)
    k = 3
    got = contrastive_loss(h, table[t], targets=t, negatives=negatives, num_negatives=k,
                   generator=torch.Generator().manual_seed(7))
    if negatives == "unique":
        cand, labels = table[torch.unique(t)], torch.unique(t, return_inverse=True)[1]
    else:
        cand, labels = table[t], torch.arange(10)
    drawn = torch.randperm(cand.size(0), generator=torch.Generator().manual_seed(7))[:k]
    assert got.item() == pytest.approx(naive_sampled(h, cand, labels, drawn), abs=1e-12)


def test_negatives_drawn_ahead_are_the_first_of_the_permutation_that_index_a_candidate():
    """What a compiled objective gets: a permutation of at least the candidates (train.py draws one of the
    micro-batch's positions on every rank); entries past the candidates are skipped."""
    from negatives import draw

    g = torch.Generator().manual_seed(6)
    h, table = torch.randn(10, 4, generator=g), torch.randn(6, 4, generator=g)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 2, 5])
    order = torch.randperm(40, generator=g)
    got = contrastive_loss(h, table[t], targets=t, negatives="unique", num_negatives=3, generator=order)
    drawn = [int(i) for i in order if i < 6][:3]
    assert got.item() == pytest.approx(naive_sampled(h, table, t, drawn), abs=1e-12)
    same = torch.randperm(10, generator=torch.Generator().manual_seed(7))  # as many as the candidates: the
    assert torch.equal(draw(10, 4, same), draw(10, 4, torch.Generator().manual_seed(7)))  # generator's draw


def test_subset_is_deterministic_with_a_seeded_generator():
    h, e = torch.randn(20, 4), torch.randn(20, 4)
    a = contrastive_loss(h, e, num_negatives=5, generator=torch.Generator().manual_seed(0))
    b = contrastive_loss(h, e, num_negatives=5, generator=torch.Generator().manual_seed(0))
    assert a.item() == b.item()
    # asking for at least as many negatives as there are rows is the full loss
    assert contrastive_loss(h, e, num_negatives=50).item() == pytest.approx(cwt_loss(h, e).item(), abs=1e-12)


def test_too_many_negatives_are_reported_once(capsys):
    from negatives import warn_if_every_negative

    warn_if_every_negative(300, candidates=256)
    warn_if_every_negative(255, candidates=256)
    assert capsys.readouterr().err.count("--num_negatives=300 is not below the 256 candidates") == 1


@pytest.mark.usefixtures("small_tiny_preset")
def test_sampled_negatives_resume_exactly(tiny_data_dir, tmp_path, monkeypatch):
    """The sampled candidates of micro-batch i are drawn from a generator seeded by i: an interrupted run
    resumed gives the same losses as a straight one."""
    import json

    from helpers import tiny_config

    import train

    for name, stop in (("straight", None), ("resumed", 3)):
        cfg = tiny_config(tiny_data_dir, tmp_path / name, max_iters=6, grad_accum=2, num_negatives=50,
                          eval_interval=3)
        if stop:
            train.train(train.TrainConfig(**{**cfg.__dict__, "max_iters": stop}))
            cfg = train.TrainConfig(**{**cfg.__dict__, "resume": True})
        train.train(cfg)
    logs = [(tmp_path / name / "log.jsonl").read_text().splitlines() for name in ("straight", "resumed")]
    losses = [{json.loads(line)["step"]: json.loads(line).get("loss") for line in log} for log in logs]
    assert losses[0] == losses[1]


@pytest.mark.usefixtures("small_tiny_preset")
def test_unique_negatives_are_charged_the_distinct_targets(tiny_data_dir, tmp_path, monkeypatch):
    """FLOPs of --negatives=unique count the U distinct targets of each micro-batch, not its N positions."""
    from helpers import tiny_config

    import data
    import train

    seen = []
    real_get = data.BatchSampler.get

    def get(self, index):
        x, y = real_get(self, index)
        seen.append(len(torch.unique(y)))
        return x, y
    monkeypatch.setattr(data.BatchSampler, "get", get)
    summary = train.train(tiny_config(tiny_data_dir, tmp_path, max_iters=3, eval_interval=3, negatives="unique"))
    model = __import__("model").build_model("tiny", 50304, block_size=32)
    expected = sum(8 * 32 * model.flops_per_token(32, u) for u in seen)
    assert len(seen) == 3 and max(seen) < 8 * 32 and summary["flops"] == pytest.approx(expected, rel=1e-12)


def test_a_drawn_ahead_permutation_shorter_than_the_candidates_is_refused():
    from negatives import draw

    assert draw(5, 3, torch.tensor([7, 4, 0, 2, 9, 1, 3])).tolist() == [4, 0, 2]  # entries past n are skipped
    with pytest.raises(ValueError, match="a drawn-ahead permutation has 4 entries but draws from 5 candidates"):
        draw(5, 3, torch.tensor([3, 0, 2, 1]))

"""Training on several datasets at once (train.py --dataset=A,B,C), as multilingual models are trained.

Each micro-batch comes from one source, drawn with probability proportional to (tokens in the source)^alpha
(--mix_alpha: 0.3 as XLM-R, 0.5 as XLM, 1.0 by size): small languages are seen more often than their size
alone would give them. The draw is a pure function of (seed, micro-batch index), like every batch, so a
resumed run goes on exactly. Validation scores each source and reports their unweighted mean."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from common import UserError, note
from data import BatchSampler, load_meta, open_split, same_tokenizer

_MIX_STREAM = 11  # keeps the source draws apart from the batches' and the masks', which share (seed, index)


def mix_probabilities(tokens: list[int], alpha: float) -> list[float]:
    """p_i = n_i^alpha / sum_j n_j^alpha, computed in log space: n^alpha overflows a float from alpha ~ 35."""
    logs = [alpha * math.log(n) for n in tokens]
    largest = max(logs)
    weights = [math.exp(x - largest) for x in logs]
    return [w / sum(weights) for w in weights]


def mean_of(values: list[float]) -> float | None:
    """A mean over the sources that have the metric; None where none has."""
    return sum(values) / len(values) if values else None


class MixedSampler:
    """BatchSampler's interface over several prepared datasets of one tokenizer."""

    def __init__(self, data_dirs: list[Path], cfg, block_size: int, vocab_size: int, device):
        metas = [load_meta(d) for d in data_dirs]
        if not all(same_tokenizer(metas[0], m) for m in metas):
            raise UserError(f"--dataset={cfg.dataset} mixes datasets of different tokenizers "
                            f"({', '.join(sorted({m['tokenizer'] for m in metas}))}); prepare them all with one "
                            "--tokenizer")
        self.names = [Path(d).name for d in data_dirs]  # each source's metrics are reported by its folder's name
        if len(set(self.names)) < len(self.names):
            raise UserError(f"--dataset={cfg.dataset} names two sources of the same folder name, whose metrics "
                            "would merge; mix distinct datasets (prepare a copy under another --name)")
        self.samplers = [BatchSampler(open_split(d, "train", vocab_size), cfg.batch_size, block_size, cfg.seed,
                                      device) for d in data_dirs]
        self.probabilities = mix_probabilities([m["train_tokens"] for m in metas], cfg.mix_alpha)
        self.cumulative, self.seed = np.cumsum(self.probabilities), cfg.seed
        note(self.describe())

    def source(self, index: int) -> int:
        """Which source micro-batch `index` comes from."""
        u = np.random.default_rng([self.seed, index, _MIX_STREAM]).random()
        return min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.samplers) - 1)

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samplers[self.source(index)].get(index)

    def describe(self) -> str:
        return "mixing " + ", ".join(f"{n} {p:.3f}" for n, p in zip(self.names, self.probabilities))

    def combine(self, per_source: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
        """Validation: each source's metrics (val_ce_NAME, ...) and, as val_*, their unweighted mean over the sources
        that have one (a metric that scored no rows of a source is None there: loss.val_metrics)."""
        first = next(iter(per_source.values()))
        mean = {k: mean_of([m[k] for m in per_source.values() if m[k] is not None]) for k in first}
        mean["val_ppl"] = math.exp(min(mean["val_ce"], 700.0))  # of the mean CE, as a single source's
        return {**mean, **{f"{k}_{name}": v for name, m in per_source.items() for k, v in m.items()}}

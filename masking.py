"""BERT masking for masked-language-model encoders (train.py --objective=mlm), the paper's other half.

Every window of T tokens has round(15% of T) positions chosen (a fixed count, as BERT's
create_pretraining_data counts them), ordinary tokens only unless a window has fewer (special ones then
make up the count); a chosen input becomes [MASK] with probability 0.8, a random ordinary token with 0.1,
and stays itself with 0.1. The losses then score the chosen positions only (masked_rows): for CWT, a
masked position's negatives are the original tokens of the other masked positions of the micro-batch, as
in the paper. Their number is the same in every micro-batch: a static shape, so torch.compile traces the
masked objective as one graph."""
from __future__ import annotations

import numpy as np
import torch

from checkpoint import MaskSpec  # declared with the checkpoint that carries it
from data import special_ids

MASK_RATE = 0.15
NOT_MASKED = -100  # the target of a position that is not predicted (F.cross_entropy's ignore_index)
VAL_MASK_SEED = 0  # validation masks are the same for every run, whatever its --seed
_MASK_STREAM = 7  # keeps the masking draws apart from BatchSampler's, which use the same (seed, index)


def mask_spec(meta: dict) -> MaskSpec:
    """The masking of a prepared dataset's tokenizer: its own [MASK] if it has one (a WordPiece tokenizer),
    else the first id past its vocabulary (GPT-2 has none); its special tokens are never masked nor drawn."""
    mask = meta.get("mask_token")
    return MaskSpec(mask_token=meta["vocab_size"] if mask is None else mask, vocab_size=meta["vocab_size"],
                    special_tokens=tuple(special_ids(meta)))


def masked_count(length: int, rate: float = MASK_RATE) -> int:
    """The positions chosen in every window of `length` tokens: round(rate x length), at least one."""
    return min(length, max(1, round(rate * length)))


def mask_tokens(tokens: torch.Tensor, seed: int, index: int, spec: MaskSpec,
                rate: float = MASK_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption of a batch (B, T) -> (inputs, targets), a pure function of (seed, index): targets
    are the original tokens at the chosen positions and NOT_MASKED elsewhere. The draws come from numpy
    on the CPU, so the masks are the same on every device."""
    rng = np.random.default_rng([seed, index, _MASK_STREAM])
    shape, device = tuple(tokens.shape), tokens.device
    keys = torch.from_numpy(rng.random(shape)).to(device)
    action = torch.from_numpy(rng.random(shape)).to(device)
    drawn = rng.integers(0, spec.vocab_size - len(spec.special_tokens), shape)
    for s in sorted(spec.special_tokens):  # step over the special ids
        drawn += drawn >= s
    replacement = torch.from_numpy(drawn).to(device)
    special = torch.isin(tokens, torch.tensor(spec.special_tokens, dtype=tokens.dtype, device=device))
    rank = (keys + special).argsort(dim=1).argsort(dim=1)  # specials rank last, in random order among them
    chosen = rank < masked_count(tokens.size(1), rate)
    inputs = torch.where(chosen & (action < 0.8), spec.mask_token, tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), replacement, inputs)
    return inputs, torch.where(chosen, tokens, NOT_MASKED)


def scored_rows(batch: int, length: int) -> int:
    """The positions a micro-batch of `batch` windows of `length` tokens scores: masked_count of each window. The
    one count the masked rows, train.py's FLOPs and its every-candidate warning all use."""
    return batch * masked_count(length)


def masked_order(targets: torch.Tensor) -> torch.Tensor:
    """The flat indices of a batch's masked positions (B, T), in order: scored_rows of them, a static number."""
    keep = targets.flatten() != NOT_MASKED
    return torch.argsort(keep.int(), descending=True, stable=True)[:scored_rows(*targets.shape)]  # masked first


def scored_targets(targets: torch.Tensor) -> torch.Tensor:
    """The targets (M,) a masked batch's loss scores, without hidden states: those of masked_rows."""
    return only_masked(targets.flatten()[masked_order(targets)])


def only_masked(picked: torch.Tensor) -> torch.Tensor:
    # Targets not made by mask_tokens may mask fewer positions than scored_rows: a kept NOT_MASKED row would be
    # scored against a wrong embedding. A device-side check: no host sync, and it compiles into the graph.
    torch._assert_async((picked != NOT_MASKED).all(), "masked_rows: a window masks fewer positions than "
                        "masked_count(T); mask its batch with mask_tokens")
    return picked


def masked_rows(h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked LM's scored rows: the hidden states (M, d) and targets (M,) of its masked positions, in order, so
    each objective runs over those alone (for CWT, the negatives are the other masked positions' tokens). M is
    fixed by masked_count: no shape depends on the data, so the objective compiles as one graph."""
    order = masked_order(targets)
    return h.flatten(0, -2)[order], only_masked(targets.flatten()[order])


class Masking:
    """What --objective=mlm does to train.py's batches: BERT masking, a pure function of (seed, index) so a
    resumed run sees the same masks; validation on fixed masks, the same for every run."""

    def __init__(self, meta: dict | None = None, seed: int = 0, spec: MaskSpec | None = None):
        self.spec = spec or mask_spec(meta)
        self.seed = seed

    def training_batch(self, x: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_tokens(x, self.seed, index, self.spec)

    def validation_batch(self, x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_tokens(x, VAL_MASK_SEED, i, self.spec)

    def scored(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return masked_rows(h, targets)

    def scored_targets(self, targets: torch.Tensor) -> torch.Tensor:
        return scored_targets(targets)

    def scored_rows(self, batch: int, length: int) -> int:
        return scored_rows(batch, length)

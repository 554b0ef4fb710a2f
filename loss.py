"""Training objectives (pure torch): cross-entropy over the vocabulary and Contrastive Weight Tying.

All losses take hidden states already flattened to rows, `h` (N, d), and return a scalar fp32 loss.
Scores are computed in the input dtype (bf16 under autocast, for tensor-core speed) and upcast to
fp32 before the softmax, which is done by `F.cross_entropy`: it subtracts the row max, so it is finite
for any score magnitude (the paper's code computes exp(scores) directly and overflows above ~88).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 scores to fp32 for the softmax (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def ce_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits `h @ weight.T` (N, V) against target ids (N,).

    `weight` is the input embedding E (weight tying, as in the paper's baselines) or a separate head.
    """
    logits = at_least_fp32(h @ weight.T)
    return F.cross_entropy(logits, targets)


def cwt_loss(
    h: torch.Tensor,
    e: torch.Tensor,
    temperature: float = 1.0,
    *,
    targets: torch.Tensor | None = None,
    negatives: Literal["all", "unique"] = "all",
    num_negatives: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Contrastive Weight Tying: row i of `h` must pick out `e[i]`, the input embedding of its target.

    Paper-faithful default (`negatives="all"`): scores S = h @ e.T / temperature over all N rows, loss =
    mean_i(logsumexp_j S_ij - S_ii). Every other position of the batch is a negative, including repeats
    of the same token. Gradients flow into both h and e.

    Extensions beyond the paper (same function, off by default):
    - `negatives="unique"` (needs `targets`): score each row against the U distinct target tokens of the
      batch instead, so repeats of the positive are no longer false negatives; cost O(N*U*d), U <= min(N, V).
    - `num_negatives=k`: score each row against its positive plus k candidates drawn at random (shared
      by all rows, without replacement) from the N rows (or U tokens); a drawn copy of the row's own
      positive is skipped.
    """
    h, e = h.reshape(-1, h.size(-1)), e.reshape(-1, e.size(-1))
    if negatives == "unique":
        if targets is None:
            raise ValueError("negatives='unique' needs the target ids (targets=...)")
        e, labels = unique_candidates(e, targets.reshape(-1))
    elif negatives == "all":
        labels = torch.arange(h.size(0), device=h.device)
    else:
        raise ValueError(f"negatives must be 'all' or 'unique', got {negatives!r}")
    if num_negatives is not None and num_negatives < e.size(0):
        return _sampled_contrastive(h, e, labels, temperature, num_negatives, generator)
    scores = at_least_fp32(h @ e.T) / temperature
    return F.cross_entropy(scores, labels)


def unique_candidates(e: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings of the distinct target tokens (U, d), and each row's index among them (N,).

    Rows of `e` for the same token are identical (same embedding row), so any copy will do: take the
    first occurrence, through which that token's gradient then flows.
    """
    uniq, labels = torch.unique(targets, return_inverse=True)
    first = torch.full((uniq.numel(),), targets.numel(), device=targets.device, dtype=torch.long)
    first.scatter_reduce_(0, labels, torch.arange(targets.numel(), device=targets.device), reduce="amin")
    return e[first], labels


def _sampled_contrastive(h, e, labels, temperature, k, generator):
    """Softmax over [positive, k shared random candidates], skipping a candidate equal to the positive."""
    drawn = torch.randperm(e.size(0), generator=generator, device="cpu")[:k].to(h.device)
    pos = at_least_fp32((h * e[labels]).sum(-1, keepdim=True)) / temperature  # (N, 1)
    neg = at_least_fp32(h @ e[drawn].T) / temperature  # (N, k)
    neg = neg.masked_fill(drawn[None, :] == labels[:, None], float("-inf"))
    scores = torch.cat([pos, neg], dim=1)
    return F.cross_entropy(scores, torch.zeros_like(labels))


@torch.no_grad()
def contrastive_accuracy(h: torch.Tensor, e: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """In-batch top-1 accuracy: the best-scoring candidate embedding is one of the row's target token.

    A repeat of the same token scores exactly like the positive, so picking it counts as correct.
    """
    h, e, targets = h.reshape(-1, h.size(-1)), e.reshape(-1, e.size(-1)), targets.reshape(-1)
    best = (h @ e.T).argmax(dim=1)
    return (targets[best] == targets).float().mean()


LossName = Literal["ce", "cwt", "ce+cwt", "nce"]


def scored_columns(loss: LossName, vocab_size: int, candidates: int, num_negatives: int | None = None) -> int:
    """How many output vectors each position is scored against (for FLOP estimates): V for `ce`; for the
    contrastive losses the candidate embeddings (the N positions of the micro-batch, or the U distinct
    tokens with unique negatives), at most k + 1 with a sampled subset of k; `ce+cwt` pays both."""
    contrastive = min(num_negatives + 1, candidates) if num_negatives else candidates
    return {"ce": vocab_size, "cwt": contrastive, "nce": contrastive, "ce+cwt": vocab_size + contrastive}[loss]


def training_loss(
    h: torch.Tensor,
    targets: torch.Tensor,
    input_embedding: torch.Tensor,
    output_weight: torch.Tensor,
    loss: LossName,
    temperature: float = 1.0,
    negatives: Literal["all", "unique"] = "all",
    num_negatives: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The pre-training objective selected by name, from hidden states (..., d) and targets (...).

    - `ce`: cross-entropy against `output_weight` (the tied E for the usual baseline).
    - `cwt`: Contrastive Weight Tying against the input embeddings of the targets.
    - `ce+cwt`: the sum of both (paper's ablation).
    - `nce`: contrastive without weight tying: targets come from the separate output table.
    """
    h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    contrastive = dict(temperature=temperature, targets=targets, negatives=negatives,
                       num_negatives=num_negatives, generator=generator)
    if loss == "ce":
        return ce_loss(h, output_weight, targets)
    if loss == "cwt":
        return cwt_loss(h, input_embedding[targets], **contrastive)
    if loss == "ce+cwt":
        return ce_loss(h, output_weight, targets) + cwt_loss(h, input_embedding[targets], **contrastive)
    if loss == "nce":
        return cwt_loss(h, output_weight[targets], **contrastive)
    raise ValueError(f"unknown loss {loss!r}; choose one of: ce, cwt, ce+cwt, nce")


def masked_rows(h: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked LM's scored rows: hidden states (M, d) and targets (M,) of the positions whose target is
    not `ignore_index`. Losses over these alone are the paper's MLM objectives: for `cwt`, the negatives
    of a masked position are the original tokens of the other masked positions of the micro-batch."""
    keep = targets != ignore_index
    return h[keep], targets[keep]

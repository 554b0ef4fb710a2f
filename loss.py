"""Training objectives (pure torch): cross-entropy over the vocabulary and Contrastive Weight Tying.

All losses take hidden states already flattened to rows, `h` (N, d), and return a scalar fp32 loss.
Scores are computed in the input dtype (bf16 under autocast, for tensor-core speed) and upcast to
fp32 before the softmax, which is done by `F.cross_entropy`: it subtracts the row max, so it is finite
for any score magnitude (the paper's code computes exp(scores) directly and overflows above ~88).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
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
    return candidate_loss(h, e, labels, temperature, num_negatives, generator)


def candidate_loss(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   num_negatives: int | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean cross-entropy of each row of `h` (N, d) over its scores against `candidates` (M, d); row i's
    positive is candidate labels[i]. With num_negatives=k, against its positive and k shared random ones."""
    if num_negatives is not None and num_negatives < candidates.size(0):
        return _sampled_contrastive(h, candidates, labels, temperature, num_negatives, generator)
    scores = at_least_fp32(h @ candidates.T) / temperature
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


# ----------------------------------------------------------------------------------------------
# Negatives from every rank (--negatives_scope=global under torchrun; not in the paper)


class _GatherRows(torch.autograd.Function):
    """All ranks' (N, ...) tensors concatenated in rank order; the gradient of each part goes back to
    the rank it came from, summed over the ranks whose losses used it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        if dist.get_backend() == "nccl":  # reduce-scatter: each rank receives only its own part
            own = grad.new_empty(grad.size(0) // dist.get_world_size(), *grad.shape[1:])
            dist.reduce_scatter_tensor(own, grad)
            return own
        dist.all_reduce(grad)  # gloo has no reduce-scatter
        return grad.chunk(dist.get_world_size())[dist.get_rank()]


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of `x`, in rank order, differentiable (x itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    if not x.requires_grad:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)
    return _GatherRows.apply(x)


def global_cwt_loss(h: torch.Tensor, e: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    negatives: Literal["all", "unique"] = "all", num_negatives: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """`cwt_loss` of this rank's rows (h, e, targets: N rows each, the same N on every rank) against the
    candidates of all ranks' micro-batches: what one process computes over the concatenated batches.
    Gradients reach the other ranks' embeddings through the gather."""
    h, e, targets = h.reshape(-1, h.size(-1)), e.reshape(-1, e.size(-1)), targets.reshape(-1)
    n, first = h.size(0), h.size(0) * (dist.get_rank() if dist.is_initialized() else 0)
    candidates = gather_rows(e)
    if negatives == "unique":  # deduplicated over every rank's targets
        candidates, labels = unique_candidates(candidates, gather_rows(targets))
        labels = labels[first:first + n]
    else:
        labels = torch.arange(first, first + n, device=h.device)
    return candidate_loss(h, candidates, labels, temperature, num_negatives, generator)


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
    negatives_scope: Literal["local", "global"] = "local",
) -> torch.Tensor:
    """The pre-training objective selected by name, from hidden states (..., d) and targets (...).

    - `ce`: cross-entropy against `output_weight` (the tied E for the usual baseline).
    - `cwt`: Contrastive Weight Tying against the input embeddings of the targets.
    - `ce+cwt`: the sum of both (paper's ablation).
    - `nce`: contrastive without weight tying: targets come from the separate output table.
    `negatives_scope="global"`: the contrastive candidates are those of every rank's micro-batch.
    """
    h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    contrastive = dict(temperature=temperature, targets=targets, negatives=negatives,
                       num_negatives=num_negatives, generator=generator)
    contrastive_loss = global_cwt_loss if negatives_scope == "global" else cwt_loss
    if loss == "ce":
        return ce_loss(h, output_weight, targets)
    if loss == "cwt":
        return contrastive_loss(h, input_embedding[targets], **contrastive)
    if loss == "ce+cwt":
        return ce_loss(h, output_weight, targets) + contrastive_loss(h, input_embedding[targets],
                                                                     **contrastive)
    if loss == "nce":
        return contrastive_loss(h, output_weight[targets], **contrastive)
    raise ValueError(f"unknown loss {loss!r}; choose one of: ce, cwt, ce+cwt, nce")

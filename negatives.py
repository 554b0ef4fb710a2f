"""Other negatives for the contrastive losses (extensions, not in the paper; train.py --negatives,
--num_negatives, --negatives_scope). The paper's negatives are every position of this rank's micro-batch.

- unique: each row scores the U distinct target tokens of the batch instead, so repeats of its own token
  are no longer false negatives; cost O(N U d) with U <= min(N, V).
- num_negatives=k: each row scores its positive plus k candidates drawn at random (shared by all rows,
  without replacement); a drawn copy of the row's own positive is skipped. The draw may come in drawn
  ahead, as a permutation (`draw`), so that a compiled objective has no random generator inside.
- scope="global" (torchrun): the candidates are every rank's rows, as one process over the concatenated
  batches; gradients reach the ranks that own them."""
from __future__ import annotations

import sys
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loss import LossConfig, Temperature, ce_loss, fp32, scaled


def contrastive_loss(h: torch.Tensor, e: torch.Tensor, temperature: Temperature = 1.0, *,
                     targets: torch.Tensor | None = None, negatives: Literal["all", "unique"] = "all",
                     num_negatives: int | None = None, generator: torch.Generator | torch.Tensor | None = None,
                     chunk_size: int | None = None, scope: Literal["local", "global"] = "local") -> torch.Tensor:
    """cwt_loss with other candidates: row i of h must pick e[i] (the embedding of targets[i])."""
    h, e = h.reshape(-1, h.size(-1)), e.reshape(-1, e.size(-1))
    n, first = h.size(0), 0
    if scope == "global":
        first = n * (dist.get_rank() if dist.is_initialized() else 0)  # this rank's rows among all ranks'
        e = gather_rows(e)
        targets = None if targets is None else gather_rows(targets.reshape(-1))
    candidates = e.size(0)  # before deduplication: known ahead, where the U distinct tokens are not
    if negatives == "unique":
        if targets is None:
            raise ValueError("negatives='unique' needs the target ids (targets=...)")
        e, labels = unique_candidates(e, targets.reshape(-1))
        labels = labels[first:first + n]
    elif negatives == "all":
        labels = torch.arange(first, first + n, device=h.device)
    else:
        raise ValueError(f"negatives must be 'all' or 'unique', got {negatives!r}")
    if num_negatives is not None and num_negatives < candidates:  # k >= U: all U, drawn, give the same loss
        return sampled_loss(h, e, labels, temperature, min(num_negatives, e.size(0)), generator, chunk_size)
    if chunk_size:
        from chunked import chunked_cross_entropy
        return chunked_cross_entropy(h, e, labels, temperature, chunk_size)
    return F.cross_entropy(scaled(fp32(h @ e.T), temperature), labels)


def training_loss_with_negatives(h: torch.Tensor, targets: torch.Tensor, input_embedding: torch.Tensor,
                                 output_weight: torch.Tensor, config: LossConfig,
                                 generator: torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
    """loss.training_loss's objectives, their contrastive part scored against config's negatives (train.objective_loss
    calls it for them)."""
    h = h.reshape(-1, h.size(-1))
    targets = targets.reshape(-1)

    def contrastive(table):
        return contrastive_loss(h, table[targets], config.temperature, targets=targets, negatives=config.negatives,
                                num_negatives=config.num_negatives, generator=generator,
                                chunk_size=config.chunk_size, scope=config.negatives_scope)
    if config.loss == "ce":
        return ce_loss(h, output_weight, targets, config.chunk_size)
    if config.loss == "cwt":
        return contrastive(input_embedding)
    if config.loss == "ce+cwt":
        return ce_loss(h, output_weight, targets, config.chunk_size) + contrastive(input_embedding)
    if config.loss == "nce":
        return contrastive(output_weight)
    raise ValueError(f"unknown loss {config.loss!r}; choose one of: ce, cwt, ce+cwt, nce")


def unique_candidates(e: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings of the distinct target tokens (U, d) and each row's index among them (N,). Rows of e
    for one token are identical, so the first occurrence serves (that token's gradient flows through it)."""
    uniq, labels = torch.unique(targets, return_inverse=True)
    first = torch.full((uniq.numel(),), targets.numel(), device=targets.device, dtype=torch.long)
    first.scatter_reduce_(0, labels, torch.arange(targets.numel(), device=targets.device), reduce="amin")
    return e[first], labels


def sampled_loss(h, e, labels, temperature, k, generator, chunk_size=None) -> torch.Tensor:
    """Softmax over [positive, k shared random candidates], skipping a candidate equal to the positive."""
    drawn = draw(e.size(0), k, generator).to(h.device)
    if chunk_size:  # each row's positive is its own extra candidate; its drawn copy (slot) is left out
        from chunked import chunked_softmax_loss
        slot = torch.full((e.size(0),), -1, device=h.device, dtype=torch.long)
        slot[drawn] = torch.arange(k, device=h.device)
        return chunked_softmax_loss(h, e[drawn], temperature, chunk_size, positives=e[labels], exclude=slot[labels])
    pos = fp32((h * e[labels]).sum(-1, keepdim=True)) / temperature  # (N, 1)
    neg = fp32(h @ e[drawn].T) / temperature  # (N, k)
    neg = neg.masked_fill(drawn[None, :] == labels[:, None], float("-inf"))
    return F.cross_entropy(torch.cat([pos, neg], dim=1), torch.zeros_like(labels))


def draw(n: int, k: int, generator: torch.Generator | torch.Tensor | None) -> torch.Tensor:
    """k of range(n) at random, without replacement: the first k entries of a permutation drawn with the
    generator, or of one drawn with it ahead (`generator` is then that permutation, of at least n entries,
    as a compiled function takes it: train.py draws it outside), skipping the entries n and above."""
    if isinstance(generator, torch.Tensor):
        if generator.numel() < n:  # a shape, known when traced: this check costs a compiled graph nothing
            raise ValueError(f"a drawn-ahead permutation has {generator.numel()} entries but draws from {n} "
                             f"candidates; draw it over at least {n} (train.py: torch.randperm(rows x world_size))")
        return generator[torch.argsort((generator >= n).int(), stable=True)[:k]]
    return torch.randperm(n, generator=generator, device="cpu")[:k]


class _GatherRows(torch.autograd.Function):
    """Every rank's (N, ...) rows in rank order; each part's gradient goes back to the rank it came from,
    summed over the ranks whose losses used it."""

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
    """Every rank's rows of x, in rank order, differentiable (x itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    return _GatherRows.apply(x)  # token ids too: an integer tensor has no gradient to send back


def distinct_targets(targets: torch.Tensor, scope: Literal["local", "global"] = "local",
                     ignore_index: int = -100) -> int:
    """How many distinct target tokens `negatives="unique"` scores for this micro-batch (every rank's under
    the global scope); an encoder's unmasked positions (ignore_index) are no target. For FLOP counts."""
    targets = targets.reshape(-1)
    if scope == "global":
        targets = gather_rows(targets)
    return int(torch.unique(targets[targets != ignore_index]).numel())


def warn_if_every_negative(num_negatives: int, candidates: int) -> None:
    """k negatives out of at most k candidates are all of them: say so rather than fall back silently."""
    if num_negatives >= candidates:
        print(f"warning: --num_negatives={num_negatives} is not below the {candidates} candidates of a "
              "micro-batch (batch_size x block_size): every candidate is scored, as without it", file=sys.stderr)

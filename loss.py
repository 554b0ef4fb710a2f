"""Training objectives (pure torch): cross-entropy over the vocabulary and Contrastive Weight Tying.

All losses take hidden states already flattened to rows, `h` (N, d), and return a scalar fp32 loss.
Scores are computed in the input dtype (bf16 under autocast, for tensor-core speed) and upcast to
fp32 before the softmax, which is done by `F.cross_entropy`: it subtracts the row max, so it is finite
for any score magnitude (the paper's code computes exp(scores) directly and overflows above ~88).
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 scores to fp32 for the softmax (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def ce_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
            chunk_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits `h @ weight.T` (N, V) against target ids (N,).

    `weight` is the input embedding E (weight tying, as in the paper's baselines) or a separate head.
    With `chunk_size`, the N x V logits are never held at once (see `chunked_cross_entropy`).
    """
    return candidate_loss(h, weight, targets, chunk_size=chunk_size)


def cwt_loss(
    h: torch.Tensor,
    e: torch.Tensor,
    temperature: float = 1.0,
    *,
    targets: torch.Tensor | None = None,
    negatives: Literal["all", "unique"] = "all",
    num_negatives: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    scope: Literal["local", "global"] = "local",
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
    - `chunk_size=c`: same value and gradients, but at most c x `TILE_COLUMNS` scores exist at a time
      instead of N x N (see `chunked_cross_entropy`).
    - `scope="global"` (under torchrun): the candidates are every rank's rows (the same N on each), as one
      process computes over the concatenated batches; gradients reach the other ranks' embeddings.
    """
    h, e = h.reshape(-1, h.size(-1)), e.reshape(-1, e.size(-1))
    n, first = h.size(0), 0
    if scope == "global":
        first = n * (dist.get_rank() if dist.is_initialized() else 0)  # this rank's rows among all ranks'
        e = gather_rows(e)
        targets = None if targets is None else gather_rows(targets.reshape(-1))
    if negatives == "unique":  # deduplicated over every rank's targets with global scope
        if targets is None:
            raise ValueError("negatives='unique' needs the target ids (targets=...)")
        e, labels = unique_candidates(e, targets.reshape(-1))
        labels = labels[first:first + n]
    elif negatives == "all":
        labels = torch.arange(first, first + n, device=h.device)
    else:
        raise ValueError(f"negatives must be 'all' or 'unique', got {negatives!r}")
    return candidate_loss(h, e, labels, temperature, num_negatives, generator, chunk_size)


def candidate_loss(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   num_negatives: int | None = None, generator: torch.Generator | None = None,
                   chunk_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of each row of `h` (N, d) over its scores against `candidates` (M, d); row i's
    positive is candidate labels[i]. With num_negatives=k, against its positive and k shared random ones."""
    if num_negatives is not None and num_negatives < candidates.size(0):
        return _sampled_contrastive(h, candidates, labels, temperature, num_negatives, generator, chunk_size)
    if chunk_size:
        return chunked_cross_entropy(h, candidates, labels, temperature, chunk_size)
    scores = at_least_fp32(h @ candidates.T)
    if temperature != 1.0:  # x / 1 == x: spare a pass over scores that may be N x V
        scores = scores / temperature
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


def _sampled_contrastive(h, e, labels, temperature, k, generator, chunk_size=None):
    """Softmax over [positive, k shared random candidates], skipping a candidate equal to the positive."""
    drawn = torch.randperm(e.size(0), generator=generator, device="cpu")[:k].to(h.device)
    pos = at_least_fp32((h * e[labels]).sum(-1, keepdim=True)) / temperature  # (N, 1)
    if chunk_size:  # logsumexp over [positive, negatives] = logaddexp(positive, logsumexp(negatives))
        slot = torch.full((e.size(0),), -1, device=h.device, dtype=torch.long)
        slot[drawn] = torch.arange(k, device=h.device)
        neg = chunked_row_losses(h, e[drawn], None, temperature, chunk_size, exclude=slot[labels])
        return (torch.logaddexp(pos.squeeze(1), neg) - pos.squeeze(1)).mean()
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
    return _GatherRows.apply(x)  # token ids too: an integer tensor simply has no gradient to send back


LossName = Literal["ce", "cwt", "ce+cwt", "nce"]


def scored_columns(loss: LossName, vocab_size: int, candidates: int, num_negatives: int | None = None) -> int:
    """How many output vectors each position is scored against (for FLOP estimates): V for `ce`; for the
    contrastive losses the candidate embeddings (the N positions of the micro-batch, or the U distinct
    tokens with unique negatives), at most k + 1 with a sampled subset of k; `ce+cwt` pays both."""
    contrastive = min(num_negatives + 1, candidates) if num_negatives else candidates
    columns = {"ce": vocab_size, "cwt": contrastive, "nce": contrastive, "ce+cwt": vocab_size + contrastive}
    return columns[loss]


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
    chunk_size: int | None = None,
    negatives_scope: Literal["local", "global"] = "local",
) -> torch.Tensor:
    """The pre-training objective selected by name, from hidden states (..., d) and targets (...).

    - `ce`: cross-entropy against `output_weight` (the tied E for the usual baseline).
    - `cwt`: Contrastive Weight Tying against the input embeddings of the targets.
    - `ce+cwt`: the sum of both (paper's ablation).
    - `nce`: contrastive without weight tying: targets come from the separate output table.
    `chunk_size` (None or 0: off) computes every score matrix in blocks, with the same result.
    `negatives_scope="global"`: the contrastive candidates are those of every rank's micro-batch.
    """
    h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
    contrastive = dict(temperature=temperature, targets=targets, negatives=negatives,
                       num_negatives=num_negatives, generator=generator, chunk_size=chunk_size,
                       scope=negatives_scope)
    if loss == "ce":
        return ce_loss(h, output_weight, targets, chunk_size)
    if loss == "cwt":
        return cwt_loss(h, input_embedding[targets], **contrastive)
    if loss == "ce+cwt":
        return (ce_loss(h, output_weight, targets, chunk_size)
                + cwt_loss(h, input_embedding[targets], **contrastive))
    if loss == "nce":
        return cwt_loss(h, output_weight[targets], **contrastive)
    raise ValueError(f"unknown loss {loss!r}; choose one of: ce, cwt, ce+cwt, nce")


# ----------------------------------------------------------------------------------------------
# Memory-flat softmax cross-entropy (the idea of Cut Cross-Entropy and Liger's fused linear CE, in torch)

TILE_COLUMNS = 32768  # widest block of candidates scored at once: bounds a tile when candidates are many


def chunked_cross_entropy(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ candidates.T / temperature) (N, M) against `labels` (N,), the
    index of each row's positive among the M candidates; gradients flow into `h` and `candidates`.

    Same value and gradients as the plain path, but the scores are made in blocks (shaped by `_tiles`)
    of at most chunk_size x min(M, TILE_COLUMNS): extra memory O(chunk_size x min(M, TILE_COLUMNS)),
    not O(N x M).
    CE: candidates = the (V, d) output weight, labels = targets. CWT: candidates = the target
    embeddings, labels = arange(N). Negatives gathered from other ranks: rows' positives at an offset.
    """
    h, candidates = h.reshape(-1, h.size(-1)), candidates.reshape(-1, candidates.size(-1))
    return chunked_row_losses(h, candidates, labels.reshape(-1), temperature, chunk_size).mean()


def chunked_row_losses(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor | None,
                       temperature: float, chunk_size: int,
                       exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Per row (N,): logsumexp of its scores minus the score of its label (labels=None: the logsumexp
    alone), leaving out candidate exclude[i] for row i where exclude[i] >= 0."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    return _ChunkedSoftmaxLoss.apply(h, candidates, labels, exclude, temperature, chunk_size,
                                     compute_dtype(h, candidates))


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """The dtype the score matmuls run in: autocast's (which never casts float64), else the inputs'."""
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])
    device = xs[0].device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


class _ChunkedSoftmaxLoss(torch.autograd.Function):
    """`chunked_row_losses`, with s = h @ candidates.T / temperature made one tile at a time.

    A custom Function rather than checkpointed blocks: the backward needs only each row's logsumexp
    (N floats) to rebuild a tile's softmax, so it recomputes each tile once and frees it at once, where
    checkpointing would replay (and hold) the forward's autograd graph of a whole row block. The loss
    gradient of the positive is folded into the tile (softmax - one-hot), so no N x M tensor or extra
    (M, d) gradient ever exists. Matmuls run in `dtype` (bf16 under autocast, like the plain path);
    logsumexp, softmax and the gradient sums are accumulated in fp32 (or fp64 for fp64 inputs).
    """

    @staticmethod
    def forward(ctx, h, candidates, labels, exclude, temperature, chunk_size, dtype):
        acc = torch.promote_types(dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            hc, cc = h.to(dtype), candidates.to(dtype)
            lse = torch.full((h.size(0),), float("-inf"), device=h.device, dtype=acc)
            pos = torch.zeros_like(lse)
            for rows, cols in _tiles(h.size(0), cc.size(0), chunk_size):
                s = _scores(hc[rows], cc[cols], cols.start, exclude, rows, temperature, acc)
                if labels is not None:
                    pos[rows] += _at_labels(s, labels[rows], cols.start)
                lse[rows] = torch.logaddexp(lse[rows], _logsumexp_(s))  # streaming over column blocks
        ctx.save_for_backward(h, candidates, labels, exclude, lse)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return lse - pos

    @staticmethod
    def backward(ctx, grad):
        h, candidates, labels, exclude, lse = ctx.saved_tensors
        dtype, acc = ctx.dtype, lse.dtype
        safe_lse = torch.where(torch.isinf(lse), 0.0, lse)  # a row with every candidate excluded
        # d loss / d (h @ candidates.T) = row_scale * (softmax - one-hot): the row scale goes on the
        # (N, d) operands rather than on every tile (h's gradient is scaled once, at the end)
        row_scale = (grad / ctx.temperature).to(acc)[:, None]
        grad_h = torch.zeros_like(h, dtype=acc) if ctx.needs_input_grad[0] else None
        grad_c = torch.zeros_like(candidates, dtype=acc) if ctx.needs_input_grad[1] else None
        with torch.autocast(h.device.type, enabled=False):
            hc, cc = h.to(dtype), candidates.to(dtype)
            scaled_h = (hc * row_scale).to(dtype) if grad_c is not None else None
            for rows, cols in _tiles(h.size(0), cc.size(0), ctx.chunk_size):
                p = _scores(hc[rows], cc[cols], cols.start, exclude, rows, ctx.temperature, acc,
                            shift=safe_lse[rows]).exp_()  # softmax of this tile, in place
                if labels is not None:
                    _add_at_labels(p, labels[rows], cols.start, -1.0)
                p = p.to(dtype)
                if grad_h is not None:
                    _add_product(grad_h[rows], p, cc[cols])
                if grad_c is not None:
                    _add_product(grad_c[cols], p.T, scaled_h[rows])
        grad_h = None if grad_h is None else grad_h.mul_(row_scale).to(h.dtype)
        grad_c = None if grad_c is None else grad_c.to(candidates.dtype)
        return grad_h, grad_c, None, None, None, None, None


def _tiles(n: int, m: int, chunk_size: int):
    """(rows, cols) slices of blocks covering the n x m scores, each of at most
    chunk_size x min(m, TILE_COLUMNS) scores.

    Where candidates outnumber rows (CE: V >> N) a block spans every row (as far as that budget allows) and
    a slice of the columns: each slice of the large (m, d) candidate gradient is then made by one matmul over
    all n rows, instead of being re-read and re-written once per row block (and by thin matmuls over
    chunk_size rows); only the small (n, d) gradient of h is accumulated. Otherwise (CWT: m <= n), blocks
    of chunk_size rows against up to TILE_COLUMNS candidates.
    """
    budget = chunk_size * min(m, TILE_COLUMNS)
    height = min(n, budget) if m > n else chunk_size
    width = min(m, TILE_COLUMNS, budget // height)
    for c0 in range(0, m, width):
        for r0 in range(0, n, height):
            yield slice(r0, r0 + height), slice(c0, c0 + width)


def _scores(h_rows, cand_cols, c0, exclude, rows, temperature, acc, shift=None):
    """Scores of a row block against a block of candidates starting at c0, upcast, minus each row's
    `shift` if given, excluded ones -inf."""
    if shift is not None and h_rows.dtype == acc:  # the matmul scales and shifts: no pass over the tile
        s = torch.addmm(-shift[:, None], h_rows, cand_cols.T, alpha=1 / temperature)
    else:
        s = (h_rows @ cand_cols.T).to(acc)  # a fresh tensor either way: edit in place
        if temperature != 1.0:  # x / 1 == x: skip a pass over the tile
            s.div_(temperature)
        if shift is not None:  # after the upcast: a bf16 shift would round the logsumexp
            s.sub_(shift[:, None])
    if exclude is not None:
        cols = torch.arange(c0, c0 + s.size(1), device=s.device)
        s.masked_fill_(exclude[rows, None] == cols[None, :], float("-inf"))
    return s


def _logsumexp_(s):
    """Per-row logsumexp of a tile, overwriting it (a row of -inf gives -inf)."""
    m = s.amax(dim=1)
    shift = torch.where(torch.isinf(m), 0.0, m)
    return s.sub_(shift[:, None]).exp_().sum(dim=1).log_().add_(shift)


def _add_product(out, a, b):
    """out += a @ b, in place (no temporary) when the dtypes agree, else through the matmul's dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += (a @ b).to(out.dtype)


def _label_slots(labels, c0, width):
    """Each row's label as a column of this tile (clamped), and whether it falls inside the tile."""
    slot = labels - c0
    inside = (slot >= 0) & (slot < width)
    return slot.clamp(0, width - 1)[:, None], inside


def _at_labels(s, labels, c0):
    slot, inside = _label_slots(labels, c0, s.size(1))
    return torch.where(inside, s.gather(1, slot).squeeze(1), 0.0)


def _add_at_labels(s, labels, c0, value):
    slot, inside = _label_slots(labels, c0, s.size(1))
    s.scatter_add_(1, slot, (inside.to(s.dtype) * value)[:, None])


def masked_rows(h: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked LM's scored rows: hidden states (M, d) and targets (M,) of the positions whose target is
    not `ignore_index`. Losses over these alone are the paper's MLM objectives: for `cwt`, the negatives
    of a masked position are the original tokens of the other masked positions of the micro-batch."""
    keep = targets != ignore_index
    return h[keep], targets[keep]

"""Memory-flat softmax cross-entropy (train.py --loss_chunk_size): the same values and gradients as the
plain losses, but no N x V logits or N x N scores are ever held; the idea of Cut Cross-Entropy (Wijmans
et al., 2024) and Liger Kernel's fused linear cross-entropy, written in plain torch."""
from __future__ import annotations

import functools

import torch

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

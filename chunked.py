"""Memory-flat softmax cross-entropy (train.py --loss_chunk_size): the same values and gradients as the
plain losses, but no N x V logits or N x N scores are ever held, only a block of chunk_size rows of them.

The gradients are made in the forward, block by block, while each block's scores are at hand, and the
backward only scales them by the incoming gradient: three matmuls per block (scores, h's gradient, the
candidates' gradient) where recomputing the scores in the backward would take four. The ideas of Liger
Kernel's fused linear cross-entropy and of Cut Cross-Entropy (Wijmans et al., 2024), in plain torch."""
from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100  # a label that scores nothing (an encoder's unmasked position), as F.cross_entropy's default


def chunked_cross_entropy(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor,
                          temperature: float | torch.Tensor = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ candidates.T / temperature) (N, M) against `labels` (N,), the
    index of each row's positive among the M candidates; gradients flow into `h` and `candidates` (and a
    tensor temperature). Rows labelled IGNORE_INDEX are left out of the mean, as F.cross_entropy does.

    CE: candidates = the (V, d) output weight, labels = targets. CWT: candidates = the target
    embeddings, labels = arange(N). Negatives gathered from other ranks: rows' positives at an offset."""
    h, candidates = h.reshape(-1, h.size(-1)), candidates.reshape(-1, candidates.size(-1))
    return chunked_softmax_loss(h, candidates, temperature, chunk_size, labels=labels.reshape(-1))


def chunked_softmax_loss(h: torch.Tensor, candidates: torch.Tensor, temperature: float | torch.Tensor,
                         chunk_size: int, *, labels: torch.Tensor | None = None,
                         positives: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the rows of h (N, d) of -log softmax(scores)[positive], where row i scores its candidates
    h_i . candidates_j / temperature, except candidate exclude[i] where exclude[i] >= 0, and its positive
    is either candidate labels[i] or, with `positives` (N, d), its own extra candidate positives[i] (the
    sampled negatives: a drawn copy of the positive is then excluded). Gradients flow into h, candidates,
    positives and a tensor temperature; they are made in the forward unless no gradient is wanted
    (torch.no_grad, validation). A row labelled IGNORE_INDEX scores nothing and is left out of the mean.

    Extra memory: one block of chunk_size x M scores, and gradients the size of the inputs."""
    _check(chunk_size, labels, positives)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and isinstance(x, torch.Tensor) and x.requires_grad for x in (h, candidates, positives,
                                                                                  temperature)]
    return _MeanLossGradInForward.apply(h, candidates, labels, positives, exclude, temperature, chunk_size,
                                        compute_dtype(h, candidates), *needs)


def chunked_row_losses(h: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor | None,
                       temperature: float | torch.Tensor, chunk_size: int,
                       exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Per row (N,): logsumexp of its scores minus the score of its label (labels=None: the logsumexp
    alone; IGNORE_INDEX: 0, as F.cross_entropy's reduction="none"), leaving out candidate exclude[i] for
    row i where exclude[i] >= 0.

    Any weighting of the rows is allowed, so the backward cannot be made ahead: it recomputes the scores
    (four matmuls per block). A mean of the rows is cheaper through chunked_softmax_loss."""
    _check(chunk_size, labels, None)
    return _RowLossesRecomputed.apply(h, candidates, labels, exclude, temperature, chunk_size,
                                      compute_dtype(h, candidates))


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """The dtype the score matmuls run in: autocast's (which never casts float64), else the inputs'."""
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in xs])
    device = xs[0].device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


def _check(chunk_size: int, labels: torch.Tensor | None, positives: torch.Tensor | None) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if labels is not None and positives is not None:
        raise ValueError("give each row's positive either as labels or as positives, not both")


def _scored(labels: torch.Tensor | None) -> torch.Tensor | None:
    """Which rows score (None: all of them): those not labelled IGNORE_INDEX."""
    return None if labels is None else labels != IGNORE_INDEX


class _MeanLossGradInForward(torch.autograd.Function):
    """chunked_softmax_loss: the mean loss, with its gradients made in the forward (`_sweep`) and kept
    until the backward scales them by the incoming gradient (a scalar)."""

    @staticmethod
    def forward(ctx, h, candidates, labels, positives, exclude, temperature, chunk_size, dtype,
                need_h, need_c, need_p, need_t):
        acc = torch.promote_types(dtype, torch.float32)
        scored = _scored(labels)
        count = h.new_tensor(h.size(0), dtype=acc) if scored is None else scored.sum().to(acc)  # 0 rows: nan
        weights = None
        if need_h or need_c or need_p or need_t:
            weights = (torch.ones(h.size(0), device=h.device, dtype=acc) if scored is None else scored.to(acc)) / count
        losses, grads = _sweep(h, candidates, labels, positives, exclude, temperature, chunk_size, dtype,
                               weights, (need_h, need_c, need_p, need_t))
        ctx.save_for_backward(*grads)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_c, grad_p, grad_t = [None if g is None else g * grad.to(g.dtype) for g in ctx.saved_tensors]
        return grad_h, grad_c, None, grad_p, None, grad_t, None, None, None, None, None, None


class _RowLossesRecomputed(torch.autograd.Function):
    """chunked_row_losses: the forward keeps no scores; the backward runs `_sweep` again with the incoming
    per-row gradients as the rows' weights."""

    @staticmethod
    def forward(ctx, h, candidates, labels, exclude, temperature, chunk_size, dtype):
        losses, _ = _sweep(h, candidates, labels, None, exclude, temperature, chunk_size, dtype, None,
                           (False, False, False, False))
        tensor_t = isinstance(temperature, torch.Tensor)
        ctx.save_for_backward(h, candidates, labels, exclude, temperature if tensor_t else None)
        ctx.temperature = None if tensor_t else temperature
        ctx.chunk_size = chunk_size
        ctx.dtype = dtype
        return losses

    @staticmethod
    def backward(ctx, grad):
        h, candidates, labels, exclude, tensor_t = ctx.saved_tensors
        temperature = ctx.temperature if tensor_t is None else tensor_t
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False, ctx.needs_input_grad[4])
        _, grads = _sweep(h, candidates, labels, None, exclude, temperature, ctx.chunk_size, ctx.dtype,
                          grad, needs)
        return grads[0], grads[1], None, None, grads[3], None, None


def _sweep(h, candidates, labels, positives, exclude, temperature, chunk_size, dtype, weights, needs):
    """Every row's loss (N,) and, given `weights` (N,), the gradients of sum_i weights_i * loss_i with
    respect to (h, candidates, positives, temperature), each None unless `needs` says so; one block of rows
    at a time. A row labelled IGNORE_INDEX has loss 0 and no gradient.

    Matmuls run in `dtype` (bf16 under autocast, as the plain path's do); the softmax and the gradient
    sums in fp32 (fp64 for fp64 inputs). A block's scores s become exp(s - shift) in place, whose row sum
    is z: the block's softmax is that over z, so 1 / z joins the per-row factors (weight / temperature),
    which go on the (rows, d) operands rather than on the block, and the -1 of each row's label is put
    in as -z. The temperature's gradient needs no pass of its own: with x = h . c / t, d loss / dt =
    -(h . d loss / dh) / t, row by row."""
    acc = torch.promote_types(dtype, torch.float32)
    need_h, need_c, need_p, need_t = needs if weights is not None else (False, False, False, False)
    scored = _scored(labels)
    if scored is not None:
        labels = torch.where(scored, labels, 0)  # an ignored row's label: any column, its weight is 0
        weights = None if weights is None else torch.where(scored, weights.to(acc), 0.0)
    with torch.autocast(h.device.type, enabled=False):
        hc = h.to(dtype)
        cc = candidates.to(dtype)
        pos = None if positives is None else _row_scores(h, positives, temperature, acc)
        losses = torch.empty(h.size(0), device=h.device, dtype=acc)
        grad_h = torch.empty_like(h, dtype=acc) if need_h or need_t else None
        grad_c = torch.zeros_like(candidates, dtype=acc) if need_c else None
        block, low = _block_buffers(min(chunk_size, h.size(0)), cc.size(0), h.device, dtype, acc)
        for start in range(0, h.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            s = _scores(block, low, hc[rows], cc, temperature, acc)
            if exclude is not None:
                _exclude_(s, exclude[rows])
            row_pos = None if pos is None else pos[rows]
            target = row_pos if labels is None else s.gather(1, labels[rows, None]).squeeze(1)
            z, shift = _exp_shifted_(s, row_pos)
            lse = shift + z.log()
            losses[rows] = lse if target is None else lse - target
            if weights is None:
                continue
            if labels is not None:  # softmax - one-hot, times z
                s.scatter_add_(1, labels[rows, None], -z[:, None])
            # d loss / d scores = weight * (softmax - one-hot); scores = h . c / temperature
            scale = torch.where(z > 0, weights[rows] / (temperature * z), 0.0)[:, None]
            d = s.to(dtype) if low is None else low[:s.size(0)].copy_(s)
            if grad_h is not None:
                grad_h[rows] = (d @ cc).to(acc) * scale
            if need_c:
                _add_product(grad_c, d.T, (hc[rows] * scale).to(dtype))
        grad_p = None
        if pos is not None and (grad_h is not None or need_p):  # the positive's own score: softmax exp(-loss), - 1
            coef = (weights * torch.expm1(-losses) / temperature)[:, None]
            if grad_h is not None:
                grad_h += coef * positives.to(acc)
            if need_p:
                grad_p = (coef * h.to(acc)).to(positives.dtype)
        grad_t = None
        if need_t:
            grad_t = (-(h.to(acc) * grad_h).sum() / temperature).to(temperature.dtype)
    if scored is not None:
        losses = torch.where(scored, losses, 0.0)
    grads = (None if grad_h is None or not need_h else grad_h.to(h.dtype),
             None if grad_c is None else grad_c.to(candidates.dtype), grad_p, grad_t)
    return losses, grads


def _block_buffers(rows, columns, device, dtype, acc):
    """One block of scores reused by every block (and its copy in the matmul dtype if that is another):
    in eager mode on a CPU, fresh pages for each block cost about as much as a pass over it. (None, None)
    under torch.compile, which plans the memory itself and would only copy the in-place edits back."""
    if torch.compiler.is_compiling():
        return None, None
    block = torch.empty(rows, columns, device=device, dtype=acc)
    return block, None if dtype == acc else torch.empty_like(block, dtype=dtype)


def _scores(block, low, h_rows, candidates, temperature, acc):
    """A block's scores in acc: written into the first rows of `block` (through `low`), or fresh."""
    if block is None:
        s = (h_rows @ candidates.T).to(acc)
    elif low is None:
        s = torch.mm(h_rows, candidates.T, out=block[:h_rows.size(0)])
    else:
        s = block[:h_rows.size(0)].copy_(torch.mm(h_rows, candidates.T, out=low[:h_rows.size(0)]))
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:  # x / 1 == x: skip a pass over the block
        s.div_(temperature)
    return s


def _row_scores(h, positives, temperature, acc):
    """Each row's score against its own positive (N,), in acc: not a matmul, so not autocast's (as plain)."""
    return (h.to(acc) * positives.to(acc)).sum(-1) / temperature


def _exclude_(s, exclude):
    """Score -inf for candidate exclude[i] of row i, where exclude[i] >= 0 (one scatter, not a mask)."""
    slot = exclude.clamp(min=0)[:, None]
    s.scatter_(1, slot, torch.where(exclude[:, None] >= 0, float("-inf"), s.gather(1, slot)))


def _exp_shifted_(s, pos):
    """s -> exp(s - shift) in place, with shift the row's largest score (its positive's too, if given);
    returns (the row sums z, positive included, and shift). A row with nothing left has z = 0."""
    shift = s.amax(dim=1)
    if pos is not None:
        shift = torch.maximum(shift, pos)
    shift = torch.where(torch.isinf(shift), 0.0, shift)
    z = s.sub_(shift[:, None]).exp_().sum(dim=1)
    if pos is not None:
        z = z + torch.exp(pos - shift)
    return z, shift


def _add_product(out, a, b):
    """out += a @ b, in place (no temporary) when the dtypes agree, else through the matmul's dtype."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += (a @ b).to(out.dtype)

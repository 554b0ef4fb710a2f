"""The training objectives in pure torch, cross-entropy over the vocabulary and the paper's Contrastive Weight
Tying (CWT), and the validation sums. Hidden states come as rows h (N, d); every loss is an fp32 scalar: scores
are made in the inputs' dtype (bf16 under autocast), then upcast for a softmax that F.cross_entropy computes
stably for any score (the paper's code takes exp(scores) directly and overflows above ~88)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

LossName = Literal["ce", "cwt", "ce+cwt", "nce"]
Temperature = float | torch.Tensor  # a number, or a tensor (a learned temperature: it gets its gradient)


# A setting of the contrastive losses only: cross-entropy has no temperature nor negatives, so train.py refuses it
# with --loss=ce (check_objective); another value on --resume would be another experiment ("resume": "same")
CONTRASTIVE = {"resume": "same", "contrastive": True}


@dataclass(kw_only=True)
class LossConfig:
    """objective settings: the loss and its negatives (loss.LossConfig)

    One piece: train.py's flags of these names (TrainConfig inherits them), a checkpoint's train_config, and what
    training_loss and validation_sums take. Each field's rule is on it (its range; "resume": "same": a resumed run
    keeps it, another value is another experiment). A field added here is a flag, travels to the losses and must
    match on --resume, with no other edit (docs/hacking.md). Built by keyword: a field goes in its natural place."""
    loss: LossName = field(default="cwt", metadata={
        "resume": "same", "help": "cwt: headless; ce: a head tied to E; ce+cwt: both; nce: cwt against a head"})
    temperature: float = field(default=1.0, metadata={"range": (1e-3, 1e3), **CONTRASTIVE,
                                                      "help": "divides the contrastive scores (the paper's: 1)"})
    negatives: Literal["all", "unique"] = field(default="all", metadata={
        **CONTRASTIVE, "help": "all: every position of the micro-batch; unique: each distinct target once"})
    num_negatives: int | None = field(default=None, metadata={
        "range": (1, 1 << 30), **CONTRASTIVE, "help": "a random subset of this many candidates; none: every one"})
    negatives_scope: Literal["local", "global"] = field(default="local", metadata={
        **CONTRASTIVE, "help": "local: this rank's micro-batch; global: every rank's (negatives.py)"})
    # the same loss, memory O(chunk x columns); may change on resume
    loss_chunk_size: int = field(default=0, metadata={
        "range": (0, 1 << 30), "help": "score this many rows at a time (chunked.py); 0: all at once"})

    @classmethod
    def of(cls, settings: Any) -> LossConfig:
        """The loss settings of a TrainConfig (or of a checkpoint's train_config dict: missing keys take their
        defaults, as in checkpoints written before a field existed)."""
        values = settings if isinstance(settings, dict) else vars(settings)
        return cls(**{f.name: values.get(f.name, f.default) for f in dataclasses.fields(cls)})

    @property
    def chunk_size(self) -> int | None:
        return self.loss_chunk_size or None

    @property
    def paper_negatives(self) -> bool:
        """Every other position of this rank's micro-batch, repeats included: the paper's negatives."""
        return self.negatives == "all" and self.num_negatives is None and self.negatives_scope == "local"


def cwt_loss(h: torch.Tensor, e: torch.Tensor, temperature: Temperature = 1.0,
             chunk_size: int | None = None) -> torch.Tensor:
    """Contrastive Weight Tying: row i of h must pick e[i], the input embedding of its own target, out of
    the target embeddings of every position of the micro-batch (in-batch negatives, repeats included).

        L = mean_i [ -log( exp(h_i . e_i / t) / sum_j exp(h_i . e_j / t) ) ]
    """
    h = h.reshape(-1, h.size(-1))
    e = e.reshape(-1, e.size(-1))
    positives = torch.arange(h.size(0), device=h.device)  # row i's target is candidate i
    if chunk_size:
        from chunked import chunked_cross_entropy  # the memory-flat extra
        return chunked_cross_entropy(h, e, positives, temperature, chunk_size)
    return F.cross_entropy(scaled(fp32(h @ e.T), temperature), positives)


def ce_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
            chunk_size: int | None = None) -> torch.Tensor:
    """The usual objective: cross-entropy of the logits h @ weight.T over the V tokens. `weight` is E
    (weight tying, the paper's baselines) or an untied head."""
    h = h.reshape(-1, h.size(-1))
    targets = targets.reshape(-1)
    if chunk_size:
        from chunked import chunked_cross_entropy
        return chunked_cross_entropy(h, weight, targets, 1.0, chunk_size)
    return F.cross_entropy(fp32(h @ weight.T), targets)


def ce_cwt_loss(h: torch.Tensor, e_table: torch.Tensor, output_weight: torch.Tensor, targets: torch.Tensor,
                temperature: Temperature = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """The paper's ablation: both objectives, summed."""
    return ce_loss(h, output_weight, targets, chunk_size) + cwt_loss(h, e_table[targets], temperature, chunk_size)


def nce_loss(h: torch.Tensor, output_weight: torch.Tensor, targets: torch.Tensor, temperature: Temperature = 1.0,
             chunk_size: int | None = None) -> torch.Tensor:
    """The paper's ablation without weight tying: contrastive, against a separate output table."""
    return cwt_loss(h, output_weight[targets], temperature, chunk_size)


def fp32(scores: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 scores upcast for the softmax (fp64 stays fp64)."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def scaled(scores: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """scores / temperature; the division of a pass over N x N scores is skipped only for the number 1, never for a
    tensor (a learned temperature that starts at 1 needs its gradient)."""
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        return scores / temperature
    return scores


def training_loss(h: torch.Tensor, targets: torch.Tensor, input_embedding: torch.Tensor,
                  output_weight: torch.Tensor, config: LossConfig,
                  generator: torch.Generator | torch.Tensor | None = None) -> torch.Tensor:
    """The pre-training objective `config.loss`, from hidden states (..., d) and targets (...), against the paper's
    negatives; `output_weight` is the LM head (or E when tied); a chunk size scores in blocks (chunked.py). Other
    negatives are negatives.training_loss_with_negatives' (the extra builds on this file, never the reverse:
    train.objective_loss picks between the two)."""
    h = h.reshape(-1, h.size(-1))
    targets = targets.reshape(-1)
    if not config.paper_negatives:
        raise ValueError("other negatives than the paper's (negatives, num_negatives, negatives_scope) are scored by "
                         "negatives.training_loss_with_negatives; train.objective_loss picks it")
    t = config.temperature
    chunk = config.chunk_size
    if config.loss == "ce":
        return ce_loss(h, output_weight, targets, chunk)
    if config.loss == "cwt":
        return cwt_loss(h, input_embedding[targets], t, chunk)
    if config.loss == "ce+cwt":
        return ce_cwt_loss(h, input_embedding, output_weight, targets, t, chunk)
    if config.loss == "nce":
        return nce_loss(h, output_weight, targets, t, chunk)
    raise ValueError(f"unknown loss {config.loss!r}; choose one of: ce, cwt, ce+cwt, nce")


def scored_columns(loss: LossName, vocab_size: int, candidates: int, num_negatives: int | None = None) -> int:
    """Output vectors each position is scored against, for FLOP counts: V for CE, the N candidates of the
    micro-batch for the contrastive losses (at most k + 1 with k sampled negatives); ce+cwt pays both."""
    contrastive = min(num_negatives + 1, candidates) if num_negatives else candidates
    return {"ce": vocab_size, "cwt": contrastive, "nce": contrastive, "ce+cwt": vocab_size + contrastive}[loss]


@torch.no_grad()
def contrastive_accuracy(h: torch.Tensor, e: torch.Tensor, targets: torch.Tensor,
                         chunk_size: int | None = None) -> torch.Tensor:
    """In-batch top-1 accuracy: the best-scoring candidate is an embedding of the row's own target token
    (a repeat of it scores exactly like the positive, so it counts as correct). Rows in chunks if asked."""
    h = h.reshape(-1, h.size(-1))
    e = e.reshape(-1, e.size(-1))
    targets = targets.reshape(-1)
    step = chunk_size or h.size(0)
    best = torch.cat([(h[i:i + step] @ e.T).argmax(dim=1) for i in range(0, h.size(0), step)])
    return (targets[best] == targets).float().mean()


# What validation_sums adds up over the batches, by name (evaluate all-reduces them as one vector)
VAL_SUMS = ("ce", "tokens", "cwt", "correct", "text_ce", "bytes")


@torch.no_grad()
def validation_sums(h: torch.Tensor, targets: torch.Tensor, output_weight: torch.Tensor, config: LossConfig,
                    contrastive: torch.Tensor | None = None, target_bytes: torch.Tensor | None = None,
                    special_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One validation batch's float64 sums, keyed as VAL_SUMS: `ce` over its `tokens` (through the model's logits);
    against `contrastive`, the CWT loss (at config's temperature) and top-1 hits over rows; given each target's UTF-8
    bytes, `text_ce` over the targets that are text (not `special_ids`) and their `bytes`: bits per byte = text_ce /
    ln 2 / bytes. Memory-flat with config's chunk size, as the run's training loss."""
    chunk_size = config.chunk_size
    h = h.reshape(-1, h.size(-1))
    y = targets.reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=h.device)
    sums = dict.fromkeys(VAL_SUMS, zero)
    if chunk_size:
        from chunked import chunked_row_losses
        row_ce = chunked_row_losses(h, output_weight, y, 1.0, chunk_size).double()
    else:
        row_ce = F.cross_entropy(fp32(h @ output_weight.T), y, reduction="none").double()
    sums["ce"] = row_ce.sum()
    sums["tokens"] = zero + y.numel()
    if contrastive is not None:
        sums["cwt"] = cwt_loss(h, contrastive[y], config.temperature, chunk_size).double() * y.numel()
        sums["correct"] = contrastive_accuracy(h, contrastive[y], y, chunk_size).double() * y.numel()
    if target_bytes is not None:
        sums["text_ce"] = (row_ce * ~torch.isin(y, special_ids)).sum()
        sums["bytes"] = target_bytes.reshape(-1).double().sum()
    return sums


class NotFinite(ArithmeticError):
    """A validation metric that is NaN or infinite: the weights or the scores diverged. (A metric of no rows is
    None, never this.) train.py stops the run before it saves; eval.py says so in one line."""

    def __init__(self, name: str, value: float):
        super().__init__(f"{name} is {value}")
        self.name, self.value = name, value


def mean_over(total: float, rows: float) -> float | None:
    """A metric's mean over the rows it was summed over; None where there were none (a rare-token metric on a split
    without one), which is no divergence."""
    return total / rows if rows else None


def val_metrics(sums: dict[str, float], contrastive: bool, bits_per_byte: bool) -> dict[str, float | None]:
    """Means of validation_sums, each over the tokens (rows) it was summed over; every one finite or None, else
    NotFinite names it: the one place that rule lives, so a metric a fork adds here is checked with no other edit."""
    ce = mean_over(sums["ce"], sums["tokens"])
    metrics = {"val_ce": ce, "val_ppl": None if ce is None else math.exp(min(ce, 700.0))}
    if contrastive:
        metrics["val_cwt"] = mean_over(sums["cwt"], sums["tokens"])
        metrics["val_acc"] = mean_over(sums["correct"], sums["tokens"])
    if bits_per_byte:
        metrics["val_bpb"] = mean_over(sums["text_ce"] / math.log(2), sums["bytes"])
    for name, value in metrics.items():
        if value is not None and not math.isfinite(value):
            raise NotFinite(name, value)
    return metrics


def contrastive_table(model: torch.nn.Module, loss: str, encoder: bool = False) -> torch.Tensor | None:
    """What the contrastive metrics score against: E (cwt, ce+cwt), the output table (nce); for ce none,
    but encoders report them for every objective (against the tied E), as the paper's tables do."""
    table = {"ce": None, "nce": model.output_weight}.get(loss, model.wte.weight)
    return model.output_weight if table is None and encoder else table

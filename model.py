"""A compact decoder-only transformer (pure torch: no files except `load_model`, no prints).

GPT-NeoX (Pythia) by default: pre-norm blocks with LayerNorm (with bias), a parallel residual
(x + attn(ln1(x)) + mlp(ln2(x))), rotary position embeddings on the first quarter of each head's
channels, causal attention through `F.scaled_dot_product_attention` (flash attention on CUDA), an exact
GELU MLP and biases on every linear layer. GPTConfig has GPT-NeoX's few switches (as nanoGPT has `bias`
for GPT-2): RMSNorm, a sequential residual, full or partial rotary, tanh GELU, no biases; and
`causal=False` makes the same model a bidirectional masked-LM encoder.

The model has no vocabulary head by default. `hidden(idx)` gives the final-normalised states that the
training losses consume. `forward(idx)` gives next-token logits: through the separate LM head when the
model has one (`GPTConfig.lm_head`: a fine-tuned headless model, or the output table of the `nce`
ablation), otherwise by scoring against the tied input embeddings, which is how CE baselines with weight
tying are trained and how a raw headless model is evaluated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 (also Pythia's NeoX size)
    block_size: int = 256  # context length
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_hidden: int | None = None  # the MLP's inner width; default 4 * d_model
    dropout: float = 0.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # LayerNorm always has a bias
    norm_eps: float = 1e-5
    bias: bool = True  # biases on every linear layer (not on the output head)
    parallel_residual: bool = True  # x + attn(ln1(x)) + mlp(ln2(x)), else x += attn(ln1(x)); x += mlp(ln2(x))
    rotary_pct: float = 0.25  # rotary on the first fraction of each head's channels, the rest position-free
    rope_base: float = 10000.0
    gelu: Literal["exact", "tanh"] = "exact"
    lm_head: bool = False  # a separate, untied output matrix (V x d) instead of scoring with E
    causal: bool = True  # False: bidirectional attention, a masked-LM encoder (train.py --objective=mlm)

    def __post_init__(self):
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.d_model

    @property
    def rotary_dims(self) -> int:
        """Rotated channels per head, int(head_dim * rotary_pct) as GPT-NeoX counts them."""
        return int(self.d_model // self.n_head * self.rotary_pct)


# Shapes only: every preset uses the GPT-NeoX defaults above, so every decoder exports to transformers.
# The vocabulary comes from the tokenizer, the attention from train.py's --objective. `pythia-70m` is the
# paper's decoder, `pythia-160m` the next size; `bert-base` its encoder and `bert-small` its ablation
# encoder (BERT's shapes, with this model's blocks); `bert-tiny` fits a CPU.
PresetName = Literal["tiny", "pythia-70m", "pythia-160m", "gpt2-124m", "bert-tiny", "bert-small", "bert-base"]
PRESETS: dict[PresetName, dict] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=256),
    "pythia-70m": dict(n_layer=6, n_head=8, d_model=512, block_size=2048),
    "pythia-160m": dict(n_layer=12, n_head=12, d_model=768, block_size=2048),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, block_size=1024),
    "bert-tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=128),
    "bert-small": dict(n_layer=4, n_head=8, d_model=512, block_size=512),
    "bert-base": dict(n_layer=12, n_head=12, d_model=768, block_size=512),  # MLP 4 x 768 = 3072
}


def padded_vocab_size(n_vocab: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding matmuls hit fast kernel shapes."""
    return multiple * math.ceil(n_vocab / multiple)


def rotary_tables(dims: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (length, dims/2) for rotary position embeddings over `dims` channels."""
    inv_freq = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.size(-1) channels of each head in pairs (i, i + half), GPT-NeoX's
    rotate-half convention, by position-dependent angles; the remaining channels pass unchanged."""
    dims = 2 * cos.size(-1)
    x1, x2 = x[..., :dims].float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
    return rotated if dims == x.size(-1) else torch.cat((rotated, x[..., dims:]), dim=-1)


class KVCache:
    """Keys and values of past positions, so generating one token costs one position, not the prefix."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype=torch.float32):
        if not config.causal:
            raise ValueError("an encoder (bidirectional attention) has no KV cache; only decoders generate")
        head_dim = config.d_model // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, config.block_size, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # number of positions already stored

    def reset(self) -> None:
        """Forget every stored position (the tensors are reused)."""
        self.pos = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, H, T, hd) for `layer`; return all keys/values so far."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.d_model % config.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.dropout
        self.causal = config.causal

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0,
                key_mask: torch.Tensor | None = None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None or cache.pos == 0:
            if cache is not None:
                cache.append(layer, k, v)
            # key_mask: the positions that may be attended to (not padding). Right-padding never reaches
            # a real position under causal attention, so only an encoder needs it.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if self.causal else key_mask, is_causal=self.causal,
                dropout_p=self.dropout if self.training else 0.0
            )
        else:
            start = cache.pos
            k, v = cache.append(layer, k, v)
            # New query i sits at absolute position start + i and may see keys up to there.
            mask = (torch.arange(k.size(2), device=x.device)
                    <= start + torch.arange(T, device=x.device)[:, None])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.mlp_hidden, bias=config.bias)
        self.down = nn.Linear(config.mlp_hidden, config.d_model, bias=config.bias)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm2 = make_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.parallel = config.parallel_residual

    def forward(self, x, cos, sin, cache=None, layer=0, key_mask=None):
        attn = self.dropout(self.attn(self.norm1(x), cos, sin, cache, layer, key_mask))
        if self.parallel:  # both branches read the same x (GPT-NeoX, GPT-J)
            return x + attn + self.dropout(self.mlp(self.norm2(x)))
        x = x + attn
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False) if config.lm_head else None
        cos, sin = rotary_tables(config.rotary_dims, config.block_size, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch adds to the stream, so shrink their output layers
        # by 1/sqrt(2 * n_layer) to keep the residual variance independent of depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, d) matrix next-token logits are scored against: the LM head, else the tied E."""
        return self.lm_head.weight if self.lm_head is not None else self.wte.weight

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normalised hidden states (B, T, d) for token ids idx (B, T). `pad_mask` (B, T), True at
        real tokens, keeps an encoder's attention off the padding of a batch of unequal lengths."""
        T = idx.size(1)
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self.drop(self.wte(idx))
        key_mask = pad_mask[:, None, None, :] if pad_mask is not None else None  # over heads and queries
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer, key_mask)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits (..., V) for hidden states h (..., d): through the LM head, else the tied E."""
        return h @ self.output_weight.T

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits (B, T, V) at every position."""
        return self.logits(self.hidden(idx, cache))

    def add_lm_head(self) -> None:
        """Give a headless model an untied LM head initialised as a copy of the input embeddings.

        At initialisation the model's logits are unchanged (same matrix); fine-tuning then lets the
        head drift away from E, which the paper shows is enough to calibrate a headless model.
        """
        if self.lm_head is not None:
            return
        self.config.lm_head = True
        self.lm_head = nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)
        self.lm_head.to(device=self.wte.weight.device, dtype=self.wte.weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.wte.weight)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count; without embeddings means without the V x d tables (E and any head)."""
        n = sum(p.numel() for p in self.parameters())
        if not embeddings:
            n -= self.wte.weight.numel() + (self.lm_head.weight.numel() if self.lm_head is not None else 0)
        return n

    def flops_per_token(self, seq_len: int, scored_columns: int) -> float:
        """Training FLOPs (forward + backward) per token, PaLM-style: 6 per weight per token in the
        blocks, attention scores 12 * n_layer * d * T, and 6 * d * C for an output layer scored
        against C columns: C = V for cross-entropy, C = the number of candidate embeddings for CWT."""
        c = self.config
        return (6 * self.num_params(embeddings=False) + 12 * c.n_layer * c.d_model * seq_len
                + 6 * c.d_model * scored_columns)

    def configure_optimizer(self, lr: float, weight_decay: float, betas: tuple[float, float],
                            eps: float = 1e-8) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices and embeddings only (norm gains and biases stay undecayed).

        Fused: one kernel updates every tensor. On CUDA that is the usual speed-up; on CPU it is ~7x
        faster than the default for-each update, which matters with a 50k x d embedding table."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = self.wte.weight.device.type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def build_model(preset: str, vocab_size: int, **overrides) -> GPT:
    """A model of a named preset shape, with any GPTConfig field overridden."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return GPT(GPTConfig(vocab_size=vocab_size, **{**PRESETS[preset], **overrides}))


def model_from_checkpoint(ckpt: dict, **config_overrides) -> GPT:
    """Rebuild the model stored in a checkpoint dict (`model` weights + `model_config`)."""
    model = GPT(GPTConfig(**{**ckpt["model_config"], **config_overrides}))
    # torch.compile prefixes names with `_orig_mod.`: strip it so compiled and eager checkpoints match
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    return model


def load_model(path: str, device: str | torch.device = "cpu") -> GPT:
    """Rebuild a model from a checkpoint written by train.py (or finetune.py), in eval mode.

    The one function of this file that reads a file: the scripts use common.load_checkpoint, which
    turns every kind of bad file into a one-line error; this is for notebooks and other programs."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise ValueError(f"{path} is not a headless-lm checkpoint (no model weights or model_config)")
    return model_from_checkpoint(ckpt).to(device).eval()

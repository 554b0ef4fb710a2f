"""The transformer: GPT-NeoX (Pythia), the paper's decoder, in pure torch (no files: checkpoint.load_model reads one).

Pre-norm blocks, a parallel residual (x + attn(ln1(x)) + mlp(ln2(x))), rotary positions on a quarter of each
head's channels, flash attention (SDPA), exact GELU, biases; GPTConfig keeps GPT-NeoX's few switches, and
causal=False makes a masked-LM encoder. Headless: hidden(idx) gives what the losses consume; forward(idx)
scores it against the LM head if there is one, else the tied embeddings E."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """The model's shape and switches. A field's range (metadata "range") is its rule for train.py's flag of the
    same name and for a checkpoint's model_config (doors.field_rules), its "help" what --help says it means;
    "resume": "kept" marks the one a run from a checkpoint may change (plan.with_model: any other given must be the
    checkpoint's)."""
    vocab_size: int = field(default=50304, metadata={  # GPT-2's 50257 padded to 64s
        "range": (1, 1 << 22), "help": "rows of the embedding table E: the tokenizer's ids, padded to 64s"})
    block_size: int = field(default=256, metadata={"range": (2, 1 << 20), "help": "context length, in tokens"})
    n_layer: int = field(default=4, metadata={"range": (1, 1024), "help": "transformer blocks"})
    n_head: int = field(default=4, metadata={"range": (1, 1024), "help": "attention heads (dividing d_model)"})
    d_model: int = field(default=128, metadata={"range": (1, 1 << 16), "help": "width of the hidden states"})
    mlp_hidden: int | None = field(default=None, metadata={"range": (1, 1 << 18),
                                                           "help": "the MLP's inner width; none: 4 * d_model"})
    dropout: float = field(default=0.0, metadata={"range": (0, 0.999999), "resume": "kept",
                                                  "help": "dropout on attention and MLP outputs"})
    norm: Literal["layernorm", "rmsnorm"] = field(default="layernorm", metadata={"help": "the blocks' normalisation"})
    norm_eps: float = field(default=1e-5, metadata={"range": (1e-30, 1), "help": "the norms' epsilon"})
    bias: bool = field(default=True, metadata={"help": "a bias on every linear layer but the output head"})
    parallel_residual: bool = field(default=True, metadata={
        "help": "x + attn(ln1(x)) + mlp(ln2(x)); false: x += attn(ln1(x)); x += mlp(ln2(x))"})
    rotary_pct: float = field(default=0.25, metadata={"range": (0, 1),
                                                      "help": "share of a head's channels rotated (rotary positions)"})
    rope_base: float = field(default=10000.0, metadata={"range": (1, 1e12), "help": "the rotary angles' base"})
    gelu: Literal["exact", "tanh"] = field(default="exact", metadata={"help": "the MLP's GELU, or its tanh form"})
    lm_head: bool = field(default=False, metadata={"help": "an untied output matrix (V x d) instead of scoring with E"})
    causal: bool = field(default=True, metadata={"help": "causal attention; false: a bidirectional masked-LM encoder"})

    @property
    def mlp_width(self) -> int:
        """The MLP's inner width: mlp_hidden, else 4 * d_model (derived when used, so it follows a replace)."""
        return self.mlp_hidden or 4 * self.d_model

    @property
    def rotary_dims(self) -> int:
        return int(self.d_model // self.n_head * self.rotary_pct)  # as GPT-NeoX rounds it


# Shapes only (the vocabulary comes from the tokenizer): the paper's decoder pythia-70m, encoder bert-base,
# ablation encoder bert-small, multilingual encoder mbert-distil (distilled mBERT's shape); tiny fits a CPU.
PresetName = Literal["tiny", "pythia-70m", "pythia-160m", "gpt2-124m", "bert-tiny", "bert-small", "bert-base",
                     "mbert-distil"]
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=256),
    "pythia-70m": dict(n_layer=6, n_head=8, d_model=512, block_size=2048),
    "pythia-160m": dict(n_layer=12, n_head=12, d_model=768, block_size=2048),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, block_size=1024),
    "bert-tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=128),
    "bert-small": dict(n_layer=4, n_head=8, d_model=512, block_size=512),
    "bert-base": dict(n_layer=12, n_head=12, d_model=768, block_size=512),
    "mbert-distil": dict(n_layer=6, n_head=12, d_model=768, block_size=512),
}


def padded_vocab_size(n_vocab: int, multiple: int = 64) -> int:
    return multiple * math.ceil(n_vocab / multiple)  # fast kernel shapes for the embedding matmuls


def rotary_tables(dims: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.empty(0).is_meta:  # a model built for its shapes (state_shapes): torch computes on meta by its compiler
        return torch.empty(length, dims // 2), torch.empty(length, dims // 2)
    inv_freq = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + half) of the first 2 * cos.size(-1) channels (GPT-NeoX's rotate-half)."""
    dims = 2 * cos.size(-1)
    x1, x2 = x[..., :dims].float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
    return rotated if dims == x.size(-1) else torch.cat((rotated, x[..., dims:]), dim=-1)


class KVCache:
    """Keys and values of past positions, so generating one token costs one position, not the prefix."""

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype=torch.float32, length: int | None = None):
        if not config.causal:
            raise ValueError("an encoder (bidirectional attention) has no KV cache; only decoders generate")
        self.length = min(length or config.block_size, config.block_size)  # positions it holds: what a run needs
        shape = (config.n_layer, batch_size, config.n_head, self.length, config.d_model // config.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # positions stored so far

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, H, T, hd) for `layer`; return all keys and values so far."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def residual_output(layer: nn.Linear) -> nn.Linear:
    """Mark a layer whose output is added to the residual stream: GPT-2's init shrinks it with depth."""
    layer.residual_output = True
    return layer


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.d_model % config.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.causal = config.causal
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = residual_output(nn.Linear(config.d_model, config.d_model, bias=config.bias))

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, key_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if cache is not None and cache.pos > 0:  # decoding: new query i sits at position start + i
            start = cache.pos
            k, v = cache.append(layer, k, v)
            mask = torch.arange(k.size(2), device=x.device) <= start + torch.arange(T, device=x.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            if cache is not None:
                cache.append(layer, k, v)
            # key_mask: the real (not padding) positions; causal attention never reaches right-padding
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if self.causal else key_mask,
                                               is_causal=self.causal,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.mlp_width, bias=config.bias)
        self.down = residual_output(nn.Linear(config.mlp_width, config.d_model, bias=config.bias))
        self.approximate = "tanh" if config.gelu == "tanh" else "none"

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


def make_norm(config: GPTConfig) -> nn.Module:
    norm = nn.RMSNorm if config.norm == "rmsnorm" else nn.LayerNorm
    return norm(config.d_model, eps=config.norm_eps)


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
        for module in self.modules():  # GPT-2's init: N(0, 0.02), the marked residual outputs shrunk with depth
            if isinstance(module, (nn.Linear, nn.Embedding)):
                depth_scaled = getattr(module, "residual_output", False)
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer) if depth_scaled
                                else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, d) matrix next-token logits are scored against: the LM head, else the tied E."""
        return self.lm_head.weight if self.lm_head is not None else self.wte.weight

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normalised hidden states (B, T, d) of token ids (B, T); `pad_mask` (B, T), True at real
        tokens, keeps an encoder's attention off the padding of a batch of unequal lengths."""
        start = cache.pos if cache is not None else 0
        end = start + idx.size(1)
        if end > self.config.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds block_size {self.config.block_size}")
        cos = self.rope_cos[start:end]
        sin = self.rope_sin[start:end]
        key_mask = pad_mask[:, None, None, :] if pad_mask is not None else None  # over heads and queries
        x = self.drop(self.wte(idx))
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer, key_mask)
        if cache is not None:
            cache.pos = end
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.output_weight.T

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden(idx, cache))  # next-token logits (B, T, V)

    def add_lm_head(self) -> None:
        """Give a headless model an untied LM head initialised as a copy of E: the logits are unchanged at
        first, then fine-tuning lets the head drift from E, which calibrates the model (the paper)."""
        if self.lm_head is None:
            self.config.lm_head = True
            self.lm_head = nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)
            self.lm_head.to(self.wte.weight.device, self.wte.weight.dtype)
            with torch.no_grad():
                self.lm_head.weight.copy_(self.wte.weight)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count; without embeddings means without the V x d tables (E and any head)."""
        total = sum(p.numel() for p in self.parameters())
        if embeddings:
            return total
        return total - self.wte.weight.numel() - (self.lm_head.weight.numel() if self.lm_head is not None else 0)

    def flops_per_token(self, seq_len: int, scored_columns: float, body_backward: bool = True) -> float:
        """Training FLOPs per token, PaLM-style: 2 per weight and 4 n_layer d T (attention scores) forward, twice
        that backward; an output layer scored against C columns (V for CE, the candidates for CWT): 2 d C forward,
        4 d C backward. A frozen body's backward makes only the output layer's weight gradient (2 d C)."""
        c = self.config
        body = 2 * self.num_params(False) + 4 * c.n_layer * c.d_model * seq_len
        output = 2 * c.d_model * scored_columns
        if body_backward:
            return 3 * body + 3 * output
        return body + 2 * output


def adamw(module: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
          eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over a module's trainable parameters, decaying matrices and embeddings only; fused (one kernel
    for every tensor: on CPU ~7x faster than the for-each update, which matters with a 50k x d table)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def optimizer_step(optimizer: torch.optim.Optimizer, parameters: Any, grad_clip: float = 1.0,
                   scaler: torch.amp.GradScaler | None = None) -> None:
    """Clip the gradient norm (0: off), step, reset the gradients; with an fp16 GradScaler, unscale first and
    skip a step whose gradients overflowed."""
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def build_model(preset: str, vocab_size: int, **overrides) -> GPT:
    """A model of a named preset shape, with any GPTConfig field overridden."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return GPT(GPTConfig(vocab_size=vocab_size, **{**PRESETS[preset], **overrides}))


class NoInitDraws(torch.overrides.TorchFunctionMode):
    """A model built on the meta device draws no init (nn.init's functions): there are no values to draw, and torch
    computes on meta through its compiler, whose import makes a cache folder in $TMPDIR (docs/failures.md)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__module__", None) == nn.init.__name__:  # nn.init hands its tensor over by name
            return kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def state_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of GPT(config)'s state dict, from a model built on the meta device: no memory."""
    with torch.device("meta"), NoInitDraws():
        return {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}


def weights_problem(config: GPTConfig, state: dict[str, torch.Tensor]) -> str | None:
    """The first way a state dict does not fit `config` (a missing, extra or misshaped tensor), or None: the layer
    count and E first, then a model built on the meta device (no memory) for every other shape."""
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    if layers != config.n_layer:
        return f"the weights hold {layers} layers but the config says {config.n_layer}"
    expected = {"wte.weight": (config.vocab_size, config.d_model)}
    if "wte.weight" in state and tuple(state["wte.weight"].shape) == expected["wte.weight"]:
        expected = state_shapes(config)
    for name, shape in expected.items():
        if name not in state:
            more = sum(k not in state for k in expected) - 1
            return f"tensor {name}{f' (and {more} more)' if more else ''} missing from the weights"
        if tuple(state[name].shape) != shape:
            return (f"tensor {name} has shape {list(state[name].shape)} in the weights but {list(shape)} in "
                    "the model its config builds")
    return next((f"tensor {k} is not in the model" for k in state if k not in expected), None)


def from_checkpoint(weights: dict[str, torch.Tensor], config: GPTConfig) -> GPT:
    """The model of a checkpoint's weights and config, the weights checked against the config first."""
    state = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}  # torch.compile's prefix
    if problem := weights_problem(config, state):
        raise ValueError(problem)
    model = GPT(config)
    model.load_state_dict(state)
    return model

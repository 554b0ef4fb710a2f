"""The Hugging Face bridge: GPT-NeoX (Pythia) checkpoints in and out of this project.

    python hf.py export --ckpt=out/ckpt.pt --out=out/hf    # a folder transformers, lm_eval and vLLM load

`load_hf("EleutherAI/pythia-70m")` (or a local folder holding config.json and model.safetensors or
pytorch_model.bin) builds a `GPT`; train.py's `--init_from=hf:...` starts from it. Export writes
config.json, model.safetensors and the tokenizer, loaded by `AutoModelForCausalLM.from_pretrained` with no
custom code and giving the same logits as `model(idx)`. Only exact equivalents cross the bridge: any
config or architecture without one (RMSNorm, rope scaling, other activations...) is a one-line error.

GPT-NeoX packs q, k, v per head ((H, 3, hd) rows of query_key_value); model.py packs them per kind
((3, H, hd) rows of qkv), so the rows are permuted both ways. Everything else maps name to name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from common import UserError, checkpoint_model, first_line, load_checkpoint, parse_flags, run_main
from data import gpt2_vocab_files, load_tokenizer
from model import GPT, PRESETS, GPTConfig

ACTIVATIONS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh"}  # HF hidden_act -> GPTConfig.gelu, both exact
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# ----------------------------------------------------------------------------------------------
# Tokenizers

# Names of the end-of-text token in Hugging Face tokenizers (GPT-2 / GPT-NeoX first).
_EOT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (e.g. Pythia's GPT-NeoX BPE) behind the part of tiktoken's
    interface this project uses: encode_ordinary(_batch), encode(text, allowed_special="all"), decode,
    n_vocab, eot_token and name. Nothing is added around the text (no BOS/EOS), as tiktoken does."""

    def __init__(self, name: str, tokenizer: Any):
        from tokenizers import Tokenizer

        self.name = name
        self._special = tokenizer  # "<|endoftext|>" written in the text is the special token
        self._ordinary = Tokenizer.from_str(tokenizer.to_str())
        # ... here it is plain text, as tiktoken's encode_ordinary
        self._ordinary.encode_special_tokens = True
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.n_vocab = max(vocab.values()) + 1
        eot = next((vocab[t] for t in _EOT_NAMES if t in vocab), None)
        if eot is None:
            raise UserError(f"tokenizer {name} has no end-of-text token ({', '.join(_EOT_NAMES)}) to "
                            "separate documents; use another tokenizer")
        self.eot_token = eot

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ordinary.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        if num_threads == 1:  # one core, as data.py's tokenising processes expect (no library threads)
            return [self.encode_ordinary(text) for text in texts]
        return [e.ids for e in self._ordinary.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, allowed_special: Literal["all"] = "all") -> list[int]:
        return self._special.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._special.decode(ids, skip_special_tokens=False)


def load_hf_tokenizer(name: str) -> HFTokenizer:
    """A tokenizer.json file, or "hf:ID": the tokenizer.json of a Hugging Face hub repository."""
    from tokenizers import Tokenizer

    path = name
    if name.startswith("hf:"):
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(name.removeprefix("hf:"), "tokenizer.json")
        except Exception as e:  # offline, no such repository, or no tokenizer.json in it
            raise UserError(f"could not get the tokenizer of {name[3:]!r} from the Hugging Face hub "
                            f"(offline?): {first_line(e)}; pass a local tokenizer.json instead") from None
    if not Path(path).is_file():
        raise UserError(f"tokenizer file {path} not found; pass an existing tokenizer.json or hf:ORG/NAME")
    try:
        return HFTokenizer(name, Tokenizer.from_file(str(path)))
    except Exception as e:
        raise UserError(f"{path} is not a Hugging Face tokenizer.json: {first_line(e)}") from None


# ----------------------------------------------------------------------------------------------
# Configs


def config_from_hf(hf: dict, source: str) -> GPTConfig:
    """The GPTConfig equal to a transformers GPT-NeoX config.json; UserError for anything else."""
    def refuse(why: str) -> UserError:
        return UserError(f"{source}: {why}; only exact GPT-NeoX equivalents are imported")

    if hf.get("model_type") != "gpt_neox":
        raise refuse(f"model_type {hf.get('model_type')!r} is not gpt_neox (Pythia)")
    if hf.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise refuse(f"hidden_act {hf.get('hidden_act')!r} is not one of {', '.join(ACTIVATIONS)}")
    rope = hf.get("rope_parameters") or {}  # transformers 5 nests the rotary settings here
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise refuse(f"rope scaling {hf.get('rope_scaling') or rope.get('rope_type')!r} is not supported")
    if not hf.get("attention_bias", True):
        raise refuse("attention_bias=false (attention without biases) is not supported")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if d % heads or hf.get("head_dim", d // heads) != d // heads:
        raise refuse(f"head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads")
    return GPTConfig(
        vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"], n_head=heads, d_model=d,
        mlp_hidden=hf.get("intermediate_size", 4 * d),
        norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5), bias=True,
        parallel_residual=hf.get("use_parallel_residual", True),
        rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
        rope_base=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000))),
        gelu=ACTIVATIONS[hf.get("hidden_act", "gelu")], lm_head=not hf.get("tie_word_embeddings", False))


def hf_config(c: GPTConfig, eot_token: int) -> dict:
    """A config.json in Pythia's own (transformers 4.x) spelling, which every later version reads."""
    if not c.causal:
        raise UserError("a masked-LM encoder (bidirectional attention) has no exact transformers GPT-NeoX "
                        "class, which is causal; export decoders, and fine-tune encoders with glue.py")
    if c.norm != "layernorm":
        raise UserError(f"--norm={c.norm}: transformers' GPT-NeoX has LayerNorm only, so this model has no "
                        "exact transformers class; export models trained with norm=layernorm")
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
        "intermediate_size": c.mlp_hidden, "hidden_act": {v: k for k, v in ACTIVATIONS.items()}[c.gelu],
        "rotary_pct": c.rotary_pct, "rotary_emb_base": c.rope_base, "max_position_embeddings": c.block_size,
        "layer_norm_eps": c.norm_eps, "use_parallel_residual": c.parallel_residual,
        "tie_word_embeddings": not c.lm_head, "attention_bias": True, "initializer_range": 0.02,
        "bos_token_id": eot_token, "eos_token_id": eot_token, "use_cache": True, "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------------------------
# Weights


def _per_kind(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPT-NeoX's (H, 3, hd) rows of query_key_value -> model.py's (3, H, hd) rows of qkv."""
    return w.reshape(n_head, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _per_head(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """model.py's (3, H, hd) rows of qkv -> GPT-NeoX's (H, 3, hd) rows of query_key_value."""
    return w.reshape(3, n_head, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


# model.py name -> GPT-NeoX name, per layer and for the whole model
_LAYER_NAMES = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm",
                "attn.qkv": "attention.query_key_value", "attn.proj": "attention.dense",
                "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}


def hf_name(name: str) -> str:
    """The GPT-NeoX name of one of model.py's parameters."""
    if name == "wte.weight":
        return "gpt_neox.embed_in.weight"
    if name == "lm_head.weight":
        return "embed_out.weight"
    if name.startswith("norm."):
        return "gpt_neox.final_layer_norm." + name.removeprefix("norm.")
    _, layer, rest = name.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    return f"gpt_neox.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"


def state_from_hf(hf_state: dict[str, torch.Tensor], model: GPT, source: str) -> dict[str, torch.Tensor]:
    """model.py's state dict from a GPT-NeoX one, in fp32 (Pythia ships fp16)."""
    hf_state = {k.replace("lm_head.", "embed_out.", 1): v for k, v in hf_state.items()}  # transformers 5 name
    state = {}
    for name in model.state_dict():
        key = hf_name(name)
        if key not in hf_state:
            raise UserError(f"{source} has no weight {key}; is it a complete GPT-NeoX checkpoint?")
        w = hf_state[key].float()
        state[name] = _per_kind(w, model.config.n_head) if ".attn.qkv." in name else w
    return state


def state_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-NeoX's state dict for a model: fp32, zero biases where the model has none (an exact
    equivalent), no embed_out when the head is tied (transformers ties it to embed_in)."""
    state = {}
    for name, w in model.state_dict().items():
        w = w.detach().float().cpu()
        state[hf_name(name)] = (_per_head(w, model.config.n_head) if ".attn.qkv." in name else w).contiguous()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.bias is None and name != "lm_head":
            state[hf_name(name + ".bias")] = torch.zeros(module.out_features)
    return state


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: model.safetensors or pytorch_model.bin, whole or sharded."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("model*.safetensors"))
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not files and not bins:
        raise UserError(f"{folder} has no {' or '.join(WEIGHT_FILES)}; is it a Hugging Face model folder?")
    state = {}
    for f in files or bins:
        state.update(load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                      weights_only=True))
    return state


# ----------------------------------------------------------------------------------------------
# Import


def _download(repo_id: str) -> Path:
    """A hub repository's config, weights and tokenizer in the local cache (nothing fetched twice)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors", "*.json",
                                                               "pytorch_model*.bin"]))
    except Exception as e:  # offline, unknown repository, gated model...
        raise UserError(f"{repo_id} is not a local folder and could not be fetched from the Hugging Face hub "
                        f"(offline?): {first_line(e)}") from None


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~"))


def tokenizer_name(folder: Path, source: str, hub: bool) -> str | None:
    """What to record as the model's tokenizer (data_meta's `tokenizer`): "gpt2" when the folder's
    tokenizer.json is GPT-2's BPE (so exported models come back to data prepared with gpt2), else hf:ID
    for a hub model or the tokenizer.json's path; None when the folder has none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    vocab = json.loads(gpt2_vocab_files()["vocab"].read_text(encoding="utf-8"))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    if model.get("vocab") == vocab and merges == _gpt2_merges():
        return "gpt2"
    return f"hf:{source}" if hub else str(path.resolve())


def load_hf(source: str) -> tuple[GPT, str | None]:
    """A GPT (fp32, eval mode) from a Hugging Face GPT-NeoX folder or hub id, and the name of its
    tokenizer for load_tokenizer / data_meta (None when the folder has no tokenizer.json)."""
    source = source.removeprefix("hf:")
    folder = Path(source).expanduser()
    hub = not folder.exists() and _looks_like_hub_id(source)
    if hub:
        folder = _download(source)
    elif not folder.is_dir():
        raise UserError(f"{source} is not a folder or a Hugging Face hub id (ORG/NAME); pass a folder with "
                        "config.json and model.safetensors, or e.g. EleutherAI/pythia-70m")
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    model = GPT(config_from_hf(hf, source))
    model.load_state_dict(state_from_hf(read_hf_weights(folder), model, source))
    return model.eval(), tokenizer_name(folder, source, hub)


def hf_checkpoint(source: str) -> dict:
    """A Hugging Face GPT-NeoX model as a checkpoint dict like train.py's, so that every script takes it
    where it takes a checkpoint: `train.py --init_from=hf:EleutherAI/pythia-70m`, `finetune.py --ckpt=hf:...`,
    `eval.py --ckpt=hf:...`, `generate.py --ckpt=hf:...`. It records the preset of the same shape, if any
    (the context length aside, which a run may shorten)."""
    model, tokenizer = load_hf(source)
    c = model.config
    preset = next((name for name, shape in PRESETS.items()
                   if all(getattr(c, k) == v for k, v in shape.items() if k != "block_size")), None)
    return {"model": model.state_dict(), "model_config": dataclasses.asdict(c),
            "data_meta": {"tokenizer": tokenizer} if tokenizer else {},
            "train_config": {"preset": preset} if preset else {}, "source": source}


# ----------------------------------------------------------------------------------------------
# Export


def _gpt2_merges() -> list[str]:
    lines = gpt2_vocab_files()["merges"].read_text(encoding="utf-8").splitlines()
    return [m for m in lines[1:] if m]  # the first line is "#version: 0.2"


def gpt2_tokenizer() -> Any:
    """GPT-2's byte-level BPE as a `tokenizers.Tokenizer`, from the same files tiktoken's gpt2 reads."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = json.loads(gpt2_vocab_files()["vocab"].read_text(encoding="utf-8"))
    merges = [tuple(m.split(" ")) for m in _gpt2_merges()]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


def save_tokenizer(name: str, out: Path, max_length: int) -> int:
    """Write the tokenizer named in a checkpoint's data_meta for AutoTokenizer; returns its EOT id."""
    enc = load_tokenizer(name)
    if name == "gpt2":
        tok = gpt2_tokenizer()
    elif isinstance(enc, HFTokenizer):  # already a tokenizers.Tokenizer
        tok = enc._special
    else:
        raise UserError(f"tokenizer {name!r} is a tiktoken encoding with no tokenizer.json; export supports "
                        "gpt2 and Hugging Face tokenizers")
    from transformers import PreTrainedTokenizerFast

    eot = tok.id_to_token(enc.eot_token)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return enc.eot_token


def export(ckpt: str, out: str) -> Path:
    """Write a checkpoint as a transformers GPT-NeoX folder (config.json, model.safetensors, tokenizer),
    into a temporary folder renamed at the end: `out` is complete or absent."""
    from safetensors.torch import save_file

    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists and is not empty; pass a new --out or remove it")
    payload = load_checkpoint(ckpt)
    model = checkpoint_model(payload, ckpt).eval()
    tokenizer = payload.get("data_meta", {}).get("tokenizer", "gpt2")
    c = model.config
    hf_config(c, 0)  # refuse an architecture without a transformers class before writing anything
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        eot = save_tokenizer(tokenizer, tmp, c.block_size)
        (tmp / "config.json").write_text(json.dumps(hf_config(c, eot), indent=2) + "\n", encoding="utf-8")
        save_file(state_to_hf(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@dataclass
class ExportConfig:
    ckpt: str = "out/ckpt.pt"  # a train.py or finetune.py checkpoint
    out: str = ""  # the folder to write (must not exist, or be empty)


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "export":
        raise UserError("usage: python hf.py export --ckpt=PATH --out=DIR")
    cfg = parse_flags(ExportConfig, argv[1:])
    if not cfg.out:
        raise UserError("missing --out=DIR: the folder to write the transformers model into")
    out = export(cfg.ckpt, cfg.out)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r})", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)

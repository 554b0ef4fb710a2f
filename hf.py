"""The Hugging Face bridge: GPT-NeoX (Pythia) checkpoints in and out of this project.

    python hf.py export --ckpt=out/ckpt.safetensors --out=out/hf    # a folder transformers, lm_eval and vLLM load

`load_hf("EleutherAI/pythia-70m")` (or a local folder holding config.json and model.safetensors, or its shards
and model.safetensors.index.json) builds a `GPT`; train.py's `--init_from=hf:...` starts from it. Export writes
config.json, model.safetensors and the tokenizer, loaded by `AutoModelForCausalLM.from_pretrained` with no
custom code and giving the same logits as `model(idx)`. Only exact equivalents cross the bridge: any
config or architecture without one (RMSNorm, rope scaling, other activations...) is a one-line error.
A folder is checked before any model is built: config.json's fields, then its sizes against the weight
files' tensor shapes (only the safetensors headers are read, by the safetensors library), so a broken or hostile
folder (a million layers, a truncated file) is one line, never a large allocation. A pytorch_model.bin (a pickle) is
never read: a folder of it alone is refused, naming the one command that converts it.

GPT-NeoX packs q, k, v per head ((H, 3, hd) rows of query_key_value); model.py packs them per kind
((3, H, hd) rows of qkv), so the rows are permuted both ways. Everything else maps name to name."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import doors
from checkpoint import Checkpoint, checkpoint_model, load_checkpoint
from cli import config_path, parse_flags
from common import UserError, check_hub, first_line, gpt2_vocab_files, run_main, through_door
from data import load_meta
from doors import brief
from io_checks import declare_io
from model import GPT, PRESETS, GPTConfig, state_shapes, weights_problem
from safe_files import remove_stale_temps, temp_path

ACTIVATIONS = {"gelu": "exact", "gelu_pytorch_tanh": "tanh"}  # HF hidden_act -> GPTConfig.gelu, both exact
MAX_POSITIONS = 1 << 20  # max_position_embeddings has no weight to check it against: a sane bound instead
MAX_SIZE = 1 << 48  # any other size in config.json (checked against the weights' shapes after this bound)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes a weight may have (as doors.WEIGHT_DTYPES)


# ------------------------ Files from outside, through their doors (doors.py): every problem is one line naming the file


def json_file(path: Path, limit: int, what: str) -> Any:
    """The JSON in a file of at most `limit` bytes (the caller checks what it holds)."""
    return through_door(doors.json_file, path, limit, what, f"pass a folder whose {what} is a JSON file")


def _short(e: BaseException, limit: int = 200) -> str:
    text = first_line(e)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------- Tokenizers

# Names of the end-of-text token in Hugging Face tokenizers (GPT-2 / GPT-NeoX first).
_EOT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")  # [SEP]: WordPiece (BERT)


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (e.g. Pythia's GPT-NeoX BPE) behind the part of tiktoken's interface
    this project uses. Nothing is added around the text (no BOS/EOS), as tiktoken does."""

    def __init__(self, name: str, tokenizer: Any):
        from tokenizers import Tokenizer
        self.name = name
        self._special = tokenizer  # "<|endoftext|>" written in the text is the special token
        self._ordinary = Tokenizer.from_str(tokenizer.to_str())
        # ... here it is plain text, as tiktoken's encode_ordinary
        self._ordinary.encode_special_tokens = True
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise UserError(f"tokenizer {name} has an empty vocabulary; use another tokenizer")
        self.n_vocab = max(vocab.values()) + 1
        eot = next((vocab[t] for t in _EOT_NAMES if t in vocab), None)
        if eot is None:
            raise UserError(f"tokenizer {name} has no end-of-text token ({', '.join(_EOT_NAMES)}) to "
                            "separate documents; use another tokenizer")
        self.eot_token = eot
        self.mask_token = vocab.get("[MASK]", vocab.get("<mask>"))  # an encoder's own [MASK], if it has one
        self.special_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.json = tokenizer.to_str()  # travels with datasets and checkpoints; compared by its sha256
        self.sha256 = hashlib.sha256(self.json.encode()).hexdigest()

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ordinary.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        if num_threads == 1:  # one core, as prepare.py's tokenising processes expect (no library threads)
            return [self.encode_ordinary(text) for text in texts]
        return [e.ids for e in self._ordinary.encode_batch(texts, add_special_tokens=False)]

    def encode_with_bytes(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's ids and the UTF-8 bytes each token stands for in its context (tokenizer.encode_with_bytes),
        from the tokens' character offsets: a Metaspace "▁" is a space only where a word starts, byte-fallback
        pieces of one character share its bytes, and the spaces WordPiece drops count with the next token."""
        out = []
        for text in texts:
            encoding = self._ordinary.encode(text, add_special_tokens=False)
            out.append((np.array(encoding.ids, dtype=np.uint32), bytes_at_offsets(text, encoding.offsets)))
        return out

    def encode(self, text: str, allowed_special: Literal["all"] = "all") -> list[int]:
        return self._special.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._special.decode(ids, skip_special_tokens=False)


def bytes_at_offsets(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """The UTF-8 bytes each token stands for, from its (start, end) character offsets in `text`: the text
    from the end of the previous token to its own end, the last token also taking what follows it. Text
    that a tokenizer drops (WordPiece's spaces) counts with the next token, so the bytes sum to the text's."""
    code_points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    char_bytes = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    byte_at = np.concatenate([[0], np.cumsum(char_bytes)])  # byte offset of each character boundary
    ends = np.maximum.accumulate(np.array([end for _, end in offsets], dtype=np.int64))
    if len(ends):
        ends[-1] = len(text)
    return np.diff(byte_at[ends], prepend=0).astype(np.uint32)


def check_same_tokenizer(out: Path, tokenizer: HFTokenizer) -> None:
    """prepare.py prepares a folder again only with the tokenizer it was prepared with (meta.json records its sha256):
    two tokenizer.json files in folders of one name, or hf:bert-base-cased and -uncased, map to one folder name."""
    try:
        old = load_meta(out)
    except UserError:
        return  # no dataset, or one its door refuses: it vouches for nothing
    if old.get("tokenizer_sha256") != tokenizer.sha256:
        raise UserError(f"{out} holds a dataset of another tokenizer ({old['tokenizer']}); preparing it with "
                        f"{tokenizer.name} would replace it: pass --name=NAME to prepare this one beside it")


def tokenizer_from_json(text: str, name: str) -> HFTokenizer:
    """The tokenizer a checkpoint carries (its tokenizer.json's text)."""
    from tokenizers import Tokenizer
    try:
        return HFTokenizer(name, Tokenizer.from_str(text))
    except (UserError, KeyboardInterrupt):  # a signal (common.Interrupted too) is not the checkpoint's fault
        raise
    except BaseException as e:  # the Rust library's errors
        raise UserError(f"the checkpoint's tokenizer ({name}) cannot be read: {_short(e)}") from None


def load_hf_tokenizer(name: str) -> HFTokenizer:
    """A tokenizer.json file, or "hf:ID": the tokenizer.json of a Hugging Face hub repository."""
    from tokenizers import Tokenizer
    path = name
    if name.startswith("hf:"):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import logging as hub_logging
        hub_logging.set_verbosity_error()  # offline, it would print each of its retries before failing
        check_hub(f"the tokenizer of {name[3:]!r}", "pass a local tokenizer.json instead")  # offline: in seconds
        try:
            path = hf_hub_download(name.removeprefix("hf:"), "tokenizer.json")
        except Exception as e:  # offline, no such repository, or no tokenizer.json in it
            raise UserError(f"could not get the tokenizer of {name[3:]!r} from the Hugging Face hub "
                            f"(offline?): {first_line(e)}; pass a local tokenizer.json instead") from None
    text = through_door(doors.tokenizer_file, path, "tokenizer file", "pass a tokenizer.json or hf:ORG/NAME")
    return HFTokenizer(name, Tokenizer.from_str(text))  # the door read it as one, within its bound


# ---------------------------------------------------------------------------------------------- Configs


def config_from_hf(hf: Any, source: str) -> GPTConfig:
    """The GPTConfig equal to a transformers GPT-NeoX config.json; UserError for anything else: another
    architecture, or a field of the wrong type or out of range (checked before anything is built)."""
    def refuse(why: str) -> UserError:
        return UserError(f"{source}: {why}; only exact GPT-NeoX equivalents are imported")

    def bad(key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{source}: config.json {key} is {brief(value)}, not {expected}; fix config.json")

    def get(key: str, default: Any = None) -> Any:  # null is absent, as transformers reads it
        value = hf.get(key)
        return default if value is None else value

    def size(key: str, default: int | None = None, high: int = MAX_SIZE) -> int:
        value = get(key, default)
        if value is None:
            raise UserError(f"{source}: config.json has no {key}; is it a complete GPT-NeoX config?")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(key, value, "a positive whole number")
        if value > high:
            raise bad(key, value, f"at most {high}")
        return value

    def number(key: str, value: Any, high: float | None = None) -> float:
        try:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(float(value))
        except OverflowError:  # an integer beyond any float
            ok = False
        if not ok or value <= 0 or (high is not None and value > high):
            raise bad(key, value, f"a number in (0, {high:g}]" if high is not None else "a positive number")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = get(key, default)
        if not isinstance(value, bool):
            raise bad(key, value, "true or false")
        return value

    if not isinstance(hf, dict):
        raise UserError(f"{source}: config.json holds a JSON {type(hf).__name__}, not an object; is it a "
                        "Hugging Face config.json?")
    if hf.get("model_type") != "gpt_neox":
        raise refuse(f"model_type {brief(hf.get('model_type'))} is not gpt_neox (Pythia)")
    act = get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise refuse(f"hidden_act {brief(act)} is not one of {', '.join(ACTIVATIONS)}")
    rope = get("rope_parameters", {})  # transformers 5 nests the rotary settings here
    if not isinstance(rope, dict):
        raise bad("rope_parameters", rope, "an object")
    rope_type = rope.get("rope_type") or "default"
    if hf.get("rope_scaling") or rope_type != "default":
        raise refuse(f"rope scaling {brief(hf.get('rope_scaling') or rope_type)} is not supported")
    if not flag("attention_bias", True):
        raise refuse("attention_bias=false (attention without biases) is not supported")
    d, heads = size("hidden_size"), size("num_attention_heads")
    head_dim = get("head_dim", d // heads)
    if d % heads or head_dim != d // heads:
        raise refuse(f"head_dim {brief(head_dim)} is not hidden_size / num_attention_heads "
                     f"({d} / {heads})")

    def rotary(key: str, old_key: str, default: float) -> tuple[str, Any]:  # transformers 5 or 4 spelling
        if rope.get(key) is not None:
            return f"rope_parameters.{key}", rope[key]
        return old_key, get(old_key, default)

    pct_key, pct = rotary("partial_rotary_factor", "rotary_pct", 0.25)
    pct = number(pct_key, pct, 1.0)
    if int(d // heads * pct) % 2:
        raise bad(pct_key, pct, f"a fraction giving an even number of rotary channels of the {d // heads} "
                  "per head")
    base_key, base = rotary("rope_theta", "rotary_emb_base", 10000)
    hidden = size("intermediate_size", 4 * d)
    return GPTConfig(
        vocab_size=size("vocab_size"), block_size=size("max_position_embeddings", 2048, MAX_POSITIONS),
        n_layer=size("num_hidden_layers"), n_head=heads, d_model=d,
        mlp_hidden=None if hidden == 4 * d else hidden,  # None: 4 x the width, as a config of ours says it
        norm="layernorm", norm_eps=number("layer_norm_eps", get("layer_norm_eps", 1e-5)), bias=True,
        parallel_residual=flag("use_parallel_residual", True), rotary_pct=pct,
        rope_base=number(base_key, base),
        gelu=ACTIVATIONS[act], lm_head=not flag("tie_word_embeddings", False))


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
        "intermediate_size": c.mlp_width, "hidden_act": {v: k for k, v in ACTIVATIONS.items()}[c.gelu],
        "rotary_pct": c.rotary_pct, "rotary_emb_base": c.rope_base, "max_position_embeddings": c.block_size,
        "layer_norm_eps": c.norm_eps, "use_parallel_residual": c.parallel_residual,
        "tie_word_embeddings": not c.lm_head, "attention_bias": True, "initializer_range": 0.02,
        "bos_token_id": eot_token, "eos_token_id": eot_token, "use_cache": True, "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------- Weights


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
    for name, target in model.state_dict().items():
        key = hf_name(name)
        if key not in hf_state:
            raise UserError(f"{source} has no weight {key}; is it a complete GPT-NeoX checkpoint?")
        w = hf_state[key]
        if w.shape != target.shape:
            raise UserError(f"{source}: tensor {key} has shape {list(w.shape)} but the model config.json "
                            f"describes needs {list(target.shape)}; the weights do not match config.json")
        w = w.float()
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


def weight_files(folder: Path) -> list[Path]:
    """The weight files: model.safetensors, or the shards model.safetensors.index.json maps tensors to; a folder of
    pytorch_model.bin alone (a pickle) is refused, naming the command that converts it (transformers')."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        table = json_file(index, doors.MAX_TEXT_BYTES, "model.safetensors.index.json")
        shards = table.get("weight_map") if isinstance(table, dict) else None
        names = set(shards.values()) if isinstance(shards, dict) else set()
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or not n.endswith(".safetensors")]
        if not names or bad:
            raise UserError(f"{index}: its weight_map does not map tensor names to .safetensors files of the folder "
                            f"({brief(bad[0]) if bad else 'none'}); download or export it again")
        return [folder / name for name in sorted(names)]
    if os.path.lexists(folder / "model.safetensors") or not any(folder.glob("pytorch_model*.bin")):
        return [folder / "model.safetensors"]
    where = str(folder.absolute())  # quoted for the shell, from any folder: a folder's name is never run
    convert = (f"from transformers import AutoModelForCausalLM as M; M.from_pretrained({where!r})"
               f".save_pretrained({where!r})")
    raise UserError(f"{folder} holds pytorch_model.bin (a pickle) and no model.safetensors; a pickle is never read "
                    f"here: if you trust it, convert it once with {shlex.join([sys.executable, '-c', convert])}")


def open_weights(path: Path) -> Any:
    """A weight file through the safetensors door (doors.safetensors_open: its header, by the library)."""
    fix = "download or export it again"
    if not os.path.lexists(path):
        raise UserError(f"{path.parent} has no {path.name}; is it a Hugging Face model folder?")
    return through_door(doors.safetensors_open, path, "weight file", fix)


def weight_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """{GPT-NeoX name: (shape, file)} of every tensor in the weight files, from their headers (no tensor is read):
    each a floating-point weight (an integer one would be cast), none in two files."""
    shapes = {}
    for f in files:
        with open_weights(f) as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                part = weights.get_slice(name)
                if part.get_dtype() not in FLOAT_DTYPES:
                    raise UserError(f"{f}: tensor {brief(name, 80)} is {part.get_dtype()}, not a floating-point weight "
                                    f"({', '.join(FLOAT_DTYPES)}); a weight is never cast from another kind of number")
                key = name.replace("lm_head.", "embed_out.", 1)  # transformers 5's name
                if key in shapes:
                    raise UserError(f"{f}: tensor {brief(name, 80)} is also in {shapes[key][1].name}; download or "
                                    "export it again")
                shapes[key] = (tuple(part.get_shape()), f)
    return shapes


_LAYER = re.compile(r"gpt_neox\.layers\.(\d{1,9})\.")


def check_shapes(shapes: dict[str, tuple[tuple[int, ...], Path]], c: GPTConfig, source: str) -> None:
    """config.json against the weights' shapes, before any model is built: a size no weight backs is refused."""
    def shape(name: str) -> str:
        return f"{name} of shape {brief(list(shapes[name][0]), 80)} in {shapes[name][1].name}"

    embed = "gpt_neox.embed_in.weight"
    if embed in shapes and shapes[embed][0] != (c.vocab_size, c.d_model):
        raise UserError(f"{source}: config.json vocab_size {c.vocab_size} and hidden_size {c.d_model} do not "
                        f"match {shape(embed)}; fix config.json")
    present = 1 + max((int(m[1]) for name in shapes if (m := _LAYER.match(name))), default=-1)
    if present != c.n_layer:
        raise UserError(f"{source}: config.json num_hidden_layers is {c.n_layer} but the weights hold "
                        f"{present} layers; fix config.json")
    up = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    if up in shapes and shapes[up][0] != (c.mlp_width, c.d_model):
        raise UserError(f"{source}: config.json intermediate_size {c.mlp_width} (and hidden_size "
                        f"{c.d_model}) do not match {shape(up)}; fix config.json")
    # Every tensor: the same check as a checkpoint's (common.checkpoint_model), against a model built on
    # the meta device, so no memory is used; the names are translated to GPT-NeoX's in the message.
    ours = list(state_shapes(c))
    state = {n: torch.empty(shapes[hf_name(n)][0], device="meta") for n in ours if hf_name(n) in shapes}
    if problem := weights_problem(c, state):
        name = re.search(r"tensor (\S+)", problem)
        problem = problem.replace(name[1], hf_name(name[1])) if name else problem
        raise UserError(f"{source}: {problem}; the weights do not match config.json")


def read_hf_weights(folder: Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's weight files (their headers checked first by weight_shapes)."""
    state = {}
    for f in files or weight_files(folder):
        with open_weights(f) as weights:
            state.update({name: weights.get_tensor(name) for name in weights.keys()})  # noqa: SIM118
    return state


# ---------------------------------------------------------------------------------------------- Import


def _download(repo_id: str) -> Path:
    """A hub repository's config, weights and tokenizer in the local cache (nothing fetched twice)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()  # offline, it would print each of its retries before failing
    check_hub(repo_id, "pass a local folder (hf:FOLDER)")  # offline: in seconds
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors", "*.json"]))
    except Exception as e:  # offline, unknown repository, gated model...
        raise UserError(f"{repo_id} is not a local folder and could not be fetched from the Hugging Face hub "
                        f"(offline?): {first_line(e)}") from None


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~"))


def tokenizer_name(folder: Path, source: str, hub: bool) -> str | None:
    """The model's data_meta `tokenizer`: "gpt2" for GPT-2's BPE (an exported model comes back to data prepared
    with gpt2), else hf:ID for a hub model or the tokenizer.json's path; None when the folder has none."""
    path = folder / "tokenizer.json"
    if not os.path.lexists(path):
        return None
    tokenizer = json_file(path, doors.MAX_TOKENIZER_BYTES, "tokenizer.json")
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict):
        raise UserError(f"{path} is not a Hugging Face tokenizer.json (no \"model\" object); remove it or "
                        "replace it with the model's tokenizer.json")
    vocab = json.loads(gpt2_vocab_files()["vocab"].read_text(encoding="utf-8"))
    merges = model.get("merges")
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges] if isinstance(merges, list) else None
    if model.get("vocab") == vocab and merges == _gpt2_merges():
        return "gpt2"
    return f"hf:{source}" if hub else str(path.resolve())


def load_hf(source: str) -> tuple[GPT, str | None]:
    """A GPT (fp32, eval mode) from a GPT-NeoX folder or hub id, and its tokenizer's name (None: no tokenizer.json)."""
    source = source.removeprefix("hf:")
    folder = Path(source)
    hub = not folder.exists() and _looks_like_hub_id(source)
    if hub:
        folder = _download(source)
    elif not folder.is_dir():
        raise UserError(f"{source} is not a folder or a Hugging Face hub id (ORG/NAME); pass a folder with "
                        "config.json and model.safetensors, or e.g. EleutherAI/pythia-70m")
    config = folder / "config.json"
    if not os.path.lexists(config):
        raise UserError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    c = config_from_hf(json_file(config, doors.MAX_TEXT_BYTES, "config.json"), source)
    tokenizer = tokenizer_name(folder, source, hub)
    files = weight_files(folder)
    check_shapes(weight_shapes(files), c, source)  # from the headers, before any allocation the config asks for
    model = GPT(c)
    model.load_state_dict(state_from_hf(read_hf_weights(folder, files), model, source))
    return model.eval(), tokenizer


def hf_checkpoint(source: str) -> Checkpoint:
    """A Hugging Face GPT-NeoX model as a checkpoint like train.py's (no state: an import), taken where a checkpoint
    is (--init_from=hf:..., --ckpt=hf:...); with the preset of its shape, if any (the context length aside)."""
    model, tokenizer = load_hf(source)
    c = model.config
    preset = next((name for name, shape in PRESETS.items()
                   if all(getattr(c, k) == v for k, v in shape.items() if k != "block_size")), None)
    meta, carried = ({"tokenizer": tokenizer} if tokenizer else {}), None
    if tokenizer and tokenizer != "gpt2":  # carried, and compared by its sha256, as a trained checkpoint's
        carried = load_hf_tokenizer(tokenizer)
        meta["tokenizer_sha256"] = carried.sha256
    return Checkpoint(model=model.state_dict(), model_config=c, data_meta=meta,
                      tokenizer_json=carried.json if carried else None,
                      train_config={"preset": preset} if preset else {})


# ---------------------------------------------------------------------------------------------- Export


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


def checkpoint_tokenizer(payload: Checkpoint, name: str) -> HFTokenizer:
    """A checkpoint's tokenizer as a Hugging Face one: the tokenizer.json it carries, else GPT-2's (the files
    tiktoken's gpt2 reads) or a tokenizer.json / hf:ID by name."""
    if payload.tokenizer_json:
        return tokenizer_from_json(payload.tokenizer_json, name)
    if name == "gpt2":
        return HFTokenizer(name, gpt2_tokenizer())
    if name.startswith("hf:") or name.endswith(".json"):
        return load_hf_tokenizer(name)
    raise UserError(f"tokenizer {name!r} has no tokenizer.json in the checkpoint; export supports gpt2 and Hugging "
                    "Face tokenizers")


def save_tokenizer(enc: HFTokenizer, out: Path, max_length: int) -> int:
    """Write a checkpoint's tokenizer (checkpoint_tokenizer) for AutoTokenizer; returns its EOT id."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(enc.json)
    from transformers import PreTrainedTokenizerFast
    eot = tok.id_to_token(enc.eot_token)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return enc.eot_token


def export_target(out: str) -> Path:
    """The folder `--out` names, as an absolute path (symbolic links in it unresolved), refused with one line
    before any work when an export could never be renamed into place there."""
    given = Path(out)
    path = Path(os.path.abspath(given))
    cwd = Path.cwd()
    if given.name in ("", ".", "..") or path == cwd or path in cwd.parents:
        raise UserError(f"--out={out} is the current folder or one above it, which an export cannot replace; "
                        "pass a new folder such as --out=hf")
    if given.is_symlink():
        raise UserError(f"--out={out} is a symbolic link; pass a new folder (an export is renamed into "
                        "place, which would replace the link, not fill the folder it points to)")
    parent = next(p for p in path.parents if os.path.lexists(p))
    if not parent.is_dir():
        raise UserError(f"--out={out}: {parent} is a file, not a folder; pass --out in a folder")
    try:
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(f"{given} already exists and is not empty; pass a new --out or remove it")
    except OSError as e:
        raise UserError(f"cannot look into --out={out}: {e.strerror}") from None
    return path


def _make_folders(folder: Path, created: list[Path]) -> None:
    """Create `folder` and its missing parents, recording each one created (to remove them on failure)."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
            created.append(folder)
        except FileExistsError:  # made meanwhile by another export into the same new folder
            if not folder.is_dir():
                raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _os_error(e: BaseException) -> int | None:
    """The errno behind a failed write: an OSError in the chain, or the "os error N" / "code: N" a Rust
    library (safetensors, tokenizers) writes into its message."""
    chained: BaseException | None = e
    while chained is not None:
        if isinstance(chained, OSError) and chained.errno:
            return chained.errno
        chained = chained.__cause__  # an explicit chain only (safe_files.write_error)
    m = re.search(r"os error (\d+)|code: (\d+)", str(e))
    return int(m[1] or m[2]) if m else None


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temporary folder to `out_dir` (absent, or the empty folder checked before); one
    line when another process has put something there meanwhile (a second export), left as it is."""
    conflict = UserError(f"{out_dir} was written by another process (another export?) while this one ran; "
                         "it was left as it is and this export's copy removed; pass another --out")
    try:
        out_dir.rmdir()  # the empty folder given as --out: a folder is renamed only over an empty one
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise conflict from None
        raise
    try:
        os.replace(tmp, out_dir)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise conflict from None
        raise


def export(ckpt: str, out: str) -> Path:
    """Write a checkpoint as a transformers GPT-NeoX folder into a temporary folder renamed at the end: `out` is
    complete or absent. A failed write is one line, and removes what the export created."""
    from safetensors.torch import save_file
    out_dir = export_target(out)
    # its train_config as plain values (an export reads none of them); an hf: source re-exported as it reads
    payload = hf_checkpoint(ckpt) if ckpt.startswith("hf:") else load_checkpoint(ckpt, None)
    model = checkpoint_model(payload, ckpt).eval()
    meta = payload.data_meta
    tokenizer = meta.get("tokenizer", "gpt2") if isinstance(meta, dict) else None
    if not isinstance(tokenizer, str):
        raise UserError(f"{ckpt}: data_meta's tokenizer is {brief(tokenizer)}, not a tokenizer name; is it "
                        "a train.py checkpoint?")
    c = model.config
    hf_config(c, 0)  # refuse an architecture without a transformers class before writing anything
    damaged = next((k for k, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()), None)
    if damaged:
        raise UserError(f"{ckpt}: weight {damaged} is not finite (NaN or infinity); a damaged or diverged model "
                        "is not exported")
    tmp = temp_path(out_dir)  # the pid (a later export removes it if this one is killed) and a random part
    created: list[Path] = []
    done = False
    try:
        _make_folders(out_dir.parent, created)
        remove_stale_temps(out_dir.parent)
        tmp.mkdir()
        eot = save_tokenizer(checkpoint_tokenizer(payload, tokenizer), tmp, c.block_size)
        (tmp / "config.json").write_text(json.dumps(hf_config(c, eot), indent=2) + "\n", encoding="utf-8")
        save_file(state_to_hf(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        readable = 0o666 & ~_umask()  # as any new file (safetensors writes 0600)
        for f in tmp.iterdir():
            f.chmod(readable)
        _move_into_place(tmp, out_dir)
        done = True
    except UserError:
        raise
    except Exception as e:
        code = _os_error(e)
        if code is None:
            raise
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on device while exporting to {out}; the partial export was "
                            "removed and nothing was written; free some space and export again") from None
        raise UserError(f"cannot write the export to {out}: {os.strerror(code)}; nothing was written; pass "
                        "--out in a writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            for folder in reversed(created):  # the deepest first; only while empty
                try:
                    folder.rmdir()
                except OSError:
                    break
    return Path(out)


@dataclass
class ExportConfig:
    ckpt: str = dataclasses.field(default="out/ckpt.safetensors", metadata={
        "help": "a train.py or finetune.py checkpoint"})
    out: str = dataclasses.field(default="", metadata={"help": "the folder to write (must not exist, or be empty)"})


def main(argv: list[str]) -> None:
    if argv[:1] in (["--help"], ["-h"]):
        parse_flags(ExportConfig, argv)  # the usage and the settings, exit code 0
    if not argv or argv[0] != "export":
        raise UserError("usage: python hf.py export --ckpt=PATH --out=DIR")
    cfg = parse_flags(ExportConfig, argv[1:])
    if not cfg.out:
        raise UserError("missing --out=DIR: the folder to write the transformers model into")
    declare_io(reads={"--ckpt": cfg.ckpt, "--config": config_path(argv)}, writes={"--out": cfg.out})
    out = export(cfg.ckpt, cfg.out)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r})", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)

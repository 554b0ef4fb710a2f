"""Sample text from a checkpoint, streaming it to the terminal as it is produced.

    python generate.py --prompt="ROMEO:"                          # out/ckpt.safetensors, as train.py writes it
    python generate.py --ckpt=out-ft/ckpt.safetensors --prompt="To be" --prompt="Once upon" --num_samples=3
    python generate.py --prompt_file=prompts.txt --temperature=0  # greedy; prompts split by blank lines

CE checkpoints, fine-tuned headless ones (their LM head) and raw headless ones (the tied embeddings, not
calibrated: finetune.py gives better text)."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import itertools
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

import cli
import devices
import doors
import io_checks
from checkpoint import checkpoint_model
from common import UserError
from devices import DeviceName, DtypeName
from load import load_source
from model import GPT, KVCache
from tokenizer import dataset_tokenizer


@dataclass
class GenerateConfig:
    ckpt: str = field(default="out/ckpt.safetensors", metadata={"help": "a train.py or finetune.py checkpoint"})
    prompt: list[str] = field(default_factory=list, metadata={
        "repeatable": True, "help": "the text to continue; repeat the flag for several prompts"})
    prompt_file: str = field(default="", metadata={"help": "or a UTF-8 file of prompts separated by blank lines"})
    max_new_tokens: int = field(default=200, metadata={
        "range": (1, 1 << 24), "help": "tokens to sample per sample; fewer at end-of-text"})
    temperature: float = field(default=0.8, metadata={"range": (0, 100),
                                                      "help": "divides the scores; 0: greedy (the most likely)"})
    top_k: int = field(default=200, metadata={"range": (0, doors.MAXIMA["vocab_size"]),
                                              "help": "sample among the k most likely tokens only; 0: off"})
    top_p: float = field(default=1.0, metadata={
        "range": (0, 1, "(]"), "help": "nucleus: the fewest tokens whose probability reaches top_p; 1: off"})
    num_samples: int = field(default=1, metadata={"range": (1, 1 << 20), "help": "samples per prompt"})
    seed: int = field(default=1337, metadata={"range": (0, 2**64 - 1),  # torch's generators take any 64-bit seed
                                              "help": "the sampling's random seed"})
    kv_cache: bool = field(default=True, metadata={
        "help": "cache the keys and values; false: recompute the context for every token (slow; for checking)"})
    device: DeviceName = field(default="auto", metadata={"help": "auto: CUDA if there is one, else the CPU"})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "auto: bfloat16 on CUDA (float16 without it), float32 on the CPU"})


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """All but the top_k largest logits (ties with the k-th kept), then all but the smallest set of most
    likely tokens reaching probability top_p, set to -inf; on (..., V). The most likely token survives."""
    if 0 < top_k < logits.size(-1):
        logits = logits.masked_fill(logits < torch.topk(logits, top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the tokens ranked above already reach top_p
        drop[..., 0] = False  # even when top_p rounds to 0 in fp32
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """One token id from logits (V,): the argmax at temperature 0, else a filtered softmax draw."""
    if not torch.isfinite(logits).all():
        raise ValueError("the model's scores are not finite (NaN or infinite weights?)")
    if temperature == 0:
        return int(logits.argmax())
    probs = filter_logits(logits.double() / temperature, top_k, top_p).softmax(dim=-1)  # fp64: tiny temperatures
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eot_token: int | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None, vocab_size: int | None = None) -> Iterator[int]:
    """Yield up to max_new_tokens new ids, one at a time; stop (without yielding it) at eot_token. With the KV
    cache a new token runs the model on one position, the same tokens at the same positions as without it. Past
    the window generation slides: the model re-reads the last block_size tokens, or a full cache is rebuilt from
    the last half window. `vocab_size` keeps sampling within the tokenizer's ids (the vocabulary is padded)."""
    if not prompt_ids:
        raise ValueError("generate() needs at least one prompt token")
    block = model.config.block_size
    device = model.wte.weight.device
    ids = list(prompt_ids)
    todo = ids[-block:]  # the tokens the model must still read
    cache = None
    if use_cache:
        autocast = torch.is_autocast_enabled(device.type)
        cache = KVCache(model.config, 1, device,
                        torch.get_autocast_dtype(device.type) if autocast else model.wte.weight.dtype,
                        length=len(todo) + max_new_tokens)  # not a whole (maybe huge) context for a short run
    for _ in range(max_new_tokens):
        common.stop_if_signalled()  # a Ctrl-C an import swallowed (run_main's handlers; never in a notebook)
        if cache is None:
            todo = ids[-block:]
        elif cache.pos + len(todo) > cache.length:  # the window is full: re-prefill from its last half
            cache.pos = 0
            todo = ids[-max(1, block // 2):]
        h = model.hidden(torch.tensor([todo], device=device), cache)[0, -1]
        token = sample_token(model.logits(h).float()[:vocab_size], temperature, top_k, top_p, generator)
        if token == eot_token:
            return
        ids.append(token)
        todo = [token]
        yield token


def read_prompts(cfg: GenerateConfig) -> list[str]:
    """Every --prompt, then the prompts of --prompt_file (separated by blank lines)."""
    prompts = list(cfg.prompt)
    if cfg.prompt_file:  # a regular file of sane size (its door), UTF-8
        fix = "pass --prompt_file=PATH to a text file"
        data = common.through_door(doors.read_small, cfg.prompt_file, doors.MAX_TEXT_BYTES, "prompt file", fix)
        try:
            text = data.decode("utf-8").replace("\r\n", "\n")  # a file saved on Windows: its blank lines too
            prompts += [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {cfg.prompt_file} is not UTF-8 (byte {e.start}); save it as UTF-8") from None
    if not prompts:
        raise UserError("no prompt given; pass --prompt=TEXT (repeat for several) or --prompt_file=PATH")
    for i, prompt in enumerate(cfg.prompt):  # a command line's bytes that were not UTF-8 (Python's surrogateescape)
        if not doors.is_text(prompt):
            raise UserError(f"--prompt {i + 1} is not UTF-8 text ({doors.clip(prompt, 40)}); pass it in UTF-8")
    return prompts


def stream_text(tokenizer, prompt_ids: list[int], new_tokens: Iterable[int], out=None) -> int:
    """Print the prompt, then each new token's text as it arrives; returns the number of new tokens. Text
    ending in an incomplete UTF-8 character (U+FFFD: a character split across tokens) is held back."""
    out = out or sys.stdout
    ids = list(prompt_ids)
    shown = 0
    for token in itertools.chain([None], new_tokens):  # None: the prompt, before the first token
        ids += [] if token is None else [token]
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    out.write(tokenizer.decode(ids)[shown:] + "\n")
    return len(ids) - len(prompt_ids)


def main(argv: list[str]) -> None:
    cfg = cli.parse_flags(GenerateConfig, argv)
    io_checks.declare_io(reads={"--ckpt": cfg.ckpt, "--prompt_file": cfg.prompt_file,
                             "--config": cli.config_path(argv)}, writes={})
    if cfg.temperature == 0:
        cli.refuse_idle(cfg, dict.fromkeys(("top_k", "top_p", "seed"), "with --temperature=0 (greedy: always the "
                                                                         "most likely token, nothing is drawn)"))
    if 0 < cfg.temperature < 1e-3:
        raise UserError(f"--temperature={cfg.temperature} is too small to mean anything but greedy; use 0 "
                        "(greedy) or at least 1e-3")
    prompts = read_prompts(cfg)
    device = devices.pick_device(cfg.device)
    dtype = devices.pick_dtype(cfg.dtype, device)
    ckpt = load_source(cfg.ckpt)  # its train_config as plain values: generating reads none of it
    model = checkpoint_model(ckpt, cfg.ckpt).to(device).eval()
    if not model.config.causal:
        raise UserError(f"{cfg.ckpt} is a masked-LM encoder (bidirectional attention) and cannot generate text; "
                        "fine-tune it with glue.py, or train a decoder (--objective=causal)")
    tokenizer = dataset_tokenizer(ckpt)
    if tokenizer.n_vocab > model.config.vocab_size:
        raise UserError(f"{cfg.ckpt} has {model.config.vocab_size} tokens but its tokenizer {tokenizer.name} has "
                        f"{tokenizer.n_vocab}: the checkpoint's data_meta names the wrong tokenizer")
    encoded = [tokenizer.encode_ordinary(p) for p in prompts]
    for i, ids in enumerate(encoded):
        which = f"prompt {i + 1}" if len(encoded) > 1 else "the prompt"
        if not 0 < len(ids) <= model.config.block_size:
            raise UserError(f"{which} is {len(ids)} tokens but must be 1 to {model.config.block_size} (the "
                            "model's context); pass some text, or shorten it")
    if ckpt.train_config.get("loss") in ("cwt", "nce"):
        print(f"note: a raw headless checkpoint (--loss={ckpt.train_config['loss']}): its scores are not "
              "calibrated probabilities; fine-tuning an LM head with finetune.py gives better text", file=sys.stderr)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    runs = [(i, s) for i in range(len(encoded)) for s in range(cfg.num_samples)]
    n_tokens = 0
    start = time.perf_counter()
    with devices.autocast_context(device, dtype):
        for i, s in runs:
            if len(runs) > 1:
                print(f"---------- prompt {i + 1}/{len(encoded)}, sample {s + 1}/{cfg.num_samples} ----------")
            tokens = generate(model, encoded[i], cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                              tokenizer.eot_token, cfg.kv_cache, generator, tokenizer.n_vocab)
            try:
                n_tokens += stream_text(tokenizer, encoded[i], tokens)
            except ValueError as e:  # non-finite scores
                raise UserError(f"{cfg.ckpt}: {e}; the checkpoint is damaged or diverged") from None
    elapsed = time.perf_counter() - start
    print(f"{n_tokens} tokens in {elapsed:.2f} s: {n_tokens / elapsed:.1f} tokens/s "
          f"({'kv cache' if cfg.kv_cache else 'no cache'}, {device.type}, {str(dtype).removeprefix('torch.')})",
          file=sys.stderr)


if __name__ == "__main__":
    common.run_main(main)

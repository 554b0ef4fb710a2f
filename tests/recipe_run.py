"""One process that runs a docs/hacking.md recipe as a user would, in a copy of the repository with its diff applied
(tests/test_hackable.py starts it there): torch imported once for every command. Its argument, a JSON object:
`flags` (the tiny run's), `stop_at` (where the stopped run stops: --stop_at), `hostile` (a table path in the
checkpoint and the value, or {"shape": [...]}: a tensor of that shape, written there), `readers` (the commands
that must refuse it besides --resume). It prints one JSON object: the logs, states and tensors of the straight and
the stopped-and-resumed runs, and each command's exit code and stderr."""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the fork's modules, not the repository's
sys.path.insert(1, str(Path.cwd() / "tests"))

import torch  # noqa: E402
from helpers import read_ckpt, read_log, save_ckpt, without_timing  # noqa: E402

import common  # noqa: E402
import train  # noqa: E402

TIMING = ("mfu",)  # besides helpers.without_timing's: a share of the device's peak, from tokens/s


def command(main, argv: list[str]) -> list:
    """`python SCRIPT.py ARGV` as a user runs it (common.run_main): its exit code and stderr."""
    sys.argv = ["script.py", *argv]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            common.run_main(main)
            code = 0
        except SystemExit as e:
            code = e.code
    return [code, err.getvalue()]


def tensors(table, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's table, by its path in it."""
    if isinstance(table, torch.Tensor):
        return {path: table}
    if isinstance(table, dict):
        return {k: v for key, value in table.items() for k, v in tensors(value, f"{path}/{key}").items()}
    if isinstance(table, list):
        return {k: v for i, value in enumerate(table) for k, v in tensors(value, f"{path}/{i}").items()}
    return {}


def log(out: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in without_timing(read_log(out))]


def made_hostile(path: str, where: list[str], value) -> None:
    """The checkpoint at `path` with `value` at `where`, written with a valid checksum (as a hostile hand would)."""
    ckpt = read_ckpt(path)
    table = ckpt
    for key in where[:-1]:
        table = table[key]
    table[where[-1]] = torch.zeros(value["shape"]) if isinstance(value, dict) else value
    save_ckpt(ckpt, path)


def main(spec: dict) -> dict:
    flags, ckpt = spec["flags"], "stopped/ckpt.safetensors"
    done = {"straight": command(train.main, [*flags, "--out_dir=straight"]),
            "stopped": command(train.main, [*flags, f"--stop_at={spec['stop_at']}", "--out_dir=stopped"]),
            "resumed": command(train.main, ["--resume", "--out_dir=stopped"])}  # alone: the rest is the run's
    straight, resumed = read_ckpt("straight/ckpt.safetensors"), read_ckpt(ckpt)
    theirs = tensors(resumed)
    done["logs"] = [log("straight"), log("stopped")]
    done["states"] = [straight["state"], resumed["state"]]
    done["tensors"] = sorted(tensors(straight))
    done["differ"] = sorted(k for k, t in tensors(straight).items() if k not in theirs or not torch.equal(t, theirs[k]))
    done["extra"] = recipe_checks(spec["recipe"], straight, spec)
    made_hostile(ckpt, spec["hostile"][0], spec["hostile"][1])
    before = Path(ckpt).read_bytes(), Path("stopped/log.jsonl").read_bytes()
    done["refused"] = [command(train.main, ["--resume", "--out_dir=stopped"])]
    done["refused"] += [command(reader_main(argv[0]), [a.format(ckpt=ckpt) for a in argv[1:]])
                        for argv in spec["readers"]]
    done["untouched"] = before == (Path(ckpt).read_bytes(), Path("stopped/log.jsonl").read_bytes())
    return done


def reader_main(script: str):
    return __import__(script.removesuffix(".py")).main


def recipe_checks(recipe: str, straight: dict, spec: dict) -> dict:
    """What a recipe promises beyond an exact resume: the weights' EMA is what readers load; the learned
    temperature is what eval.py scores with."""
    import checkpoint
    if recipe == "ema":
        path = "straight/ckpt.safetensors"
        read = checkpoint.checkpoint_model(checkpoint.load_checkpoint(path), path).state_dict()
        loaded = checkpoint.load_model(path).state_dict()
        return {"readers_get_the_ema": all(torch.equal(read[k], t) and torch.equal(loaded[k], t)
                                           for k, t in straight["ema"].items()),
                "ema_is_not_the_weights": not torch.equal(straight["ema"]["wte.weight"],
                                                  straight["model"]["wte.weight"]),
                "generate": command(reader_main("generate.py"), [f"--ckpt={path}", "--prompt=a", "--max_new_tokens=2",
                                                                 "--device=cpu"])}
    if recipe == "temperature":
        import eval as evaluation
        result = evaluation.main(["--ckpt=straight/ckpt.safetensors", "--task=val", "--max_batches=1",
                                  "--batch_size=8", "--device=cpu", f"--data_root={spec['data_root']}"])
        return {"log_temperature": straight["objective"]["log_temperature"].item(), "val_cwt": result["val_cwt"]}
    return {}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1])), default=str))

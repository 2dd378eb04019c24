"""Does `train` end within its time budget, on the bundled model and on a bigger one?

    python scripts/budget_check.py --method medusa --max-minutes 8 [--scale 4]
                                   [--out docs/budget]

Runs `python launcher.py train` as a user would, from nothing (fresh data and cache
folders), and reports its wall time against the budget with each stage's share. --scale N
first builds a model about N times the bundled one's size (the same family, tokenizer and
chat template, wider and deeper, random weights) in a local folder and trains on that: its
answers are noise, but every stage costs what it would on a real model of that size, which
is what the budget has to hold for. Writes <method>-x<scale>.json into --out. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import ModelSpec  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.paths import cache_dir  # noqa: E402


def scaled_model(scale: float, folder: Path) -> int:
    """Save a model `scale` times the bundled one's parameters into `folder`; returns its
    parameter count. Width and depth grow together (width by sqrt(scale) in whole heads,
    depth makes up the rest), as model families grow."""
    import torch
    from transformers import AutoModelForCausalLM

    base = load_model(ModelSpec(quant="bf16"))
    config = base.model.config.to_dict()
    base_params = sum(p.numel() for p in base.model.parameters())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    heads = round(config["num_attention_heads"] * scale**0.5)
    kv = max(1, round(heads * config["num_key_value_heads"] / config["num_attention_heads"]))
    heads = kv * max(1, heads // kv)  # grouped attention: heads a multiple of kv heads
    width = heads * head_dim
    config.update(hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=round(config["intermediate_size"] * width
                                          / config["hidden_size"] / 64) * 64)
    per_layer = 2 * width * width + 2 * width * kv * head_dim + 3 * width * config[
        "intermediate_size"]
    embed = config["vocab_size"] * width
    config["num_hidden_layers"] = max(1, round((scale * base_params - embed) / per_layer))
    config.pop("quantization_config", None)
    cfg = type(base.model.config).from_dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    base.tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["medusa", "kangaroo"], default="medusa")
    parser.add_argument("--max-minutes", type=float, default=8.0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "budget")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="quickdraft-budget-"))
    env = {**os.environ, "QUICKDRAFT_DATA_DIR": str(work / "data"),
           "QUICKDRAFT_CACHE_DIR": str(work / "cache")}
    # The bundled model's one-time conversion is not part of a training run: reuse it.
    converted = cache_dir() / "models"
    if converted.is_dir():
        shutil.copytree(converted, work / "cache" / "models")
    model, params = "default", None
    if args.scale != 1.0:
        model = str(work / "model")
        params = scaled_model(args.scale, Path(model))
        print(f"built a {params / 1e6:.0f}M-parameter model in {model}", flush=True)
    command = [sys.executable, str(ROOT / "launcher.py"), "train", "--method", args.method,
               "--model", model, "--max-minutes", str(args.max_minutes), "--no-chats"]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    metrics = json.loads(next((work / "data").rglob("metrics.json")).read_text())
    shutil.rmtree(work)  # the scaled model alone is ~1 GB
    budget = args.max_minutes * 60
    times = metrics["times"]
    # The job's own time (train_accelerator, what the budget covers) and the command's
    # (process start and model load included).
    report = {"method": args.method, "scale": args.scale, "parameters": params,
              "budget_s": budget, "job_s": times["total_s"], "command_s": round(wall, 1),
              "over_budget": round(times["total_s"] / budget - 1, 3), "stages_s": times,
              "shares": {k: round(v / budget, 3) for k, v in times.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.method}-x{args.scale:g}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

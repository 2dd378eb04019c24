"""Time the trainer's data stage alone: answer tokens per second of self-distillation.

    python scripts/bench_data.py [--conversations 128] [--quant bf16] [--batch 64]

Answers the same first seed conversations (the stage's first, greedy pass) with each
variant into throw-away files, to the end, and prints one table:
`generate()` on fixed batches (how every model whose cache rows cannot be swapped is
answered) against continuous batching (trainer/sampler.py) at each batch size. Run it
alone: another torch process on the same cores distorts every figure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import ModelSpec  # noqa: E402
from engine.loading import load_model  # noqa: E402
from trainer import answering  # noqa: E402
from trainer.selfdistill import DataBudget, generate_data  # noqa: E402


def one_run(lm, budget: DataBudget, streamed: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(answering, "supports_refill", lambda lm: streamed):
        start = time.perf_counter()
        summary = generate_data(lm, Path(tmp) / "c.jsonl", None, budget, lambda p: None)
        summary["wall"] = time.perf_counter() - start
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=128, help="per variant")
    parser.add_argument("--quant", default="auto", help="bf16 | fp32 | auto ...")
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", default="64", help="batch sizes for continuous batching")
    parser.add_argument("--generate-batch", type=int, default=32,
                        help="batch size of the generate() variant (0: skip it)")
    args = parser.parse_args()
    lm = load_model(ModelSpec(source=args.model, quant=args.quant))
    print(f"model {lm.model_id} ({lm.quant}, {lm.device}), {args.conversations} conversations"
          " per variant")
    variants = [(f"generate() batches of {args.generate_batch}", args.generate_batch, False)]
    variants = variants if args.generate_batch else []
    variants += [(f"continuous batching, {b} rows", int(b), True) for b in args.batch.split(",")]
    rows = []
    for name, batch, streamed in variants:
        budget = DataBudget(max_conversations=args.conversations, max_seconds=1e9,
                            batch_size=batch)
        s = one_run(lm, budget, streamed)
        rows.append((name, s["conversations"], s["tokens"], s["wall"], s["tokens"] / s["wall"]))
        print(f"  {name}: {s['tokens']} tokens, {s['conversations']} conversations in "
              f"{s['wall']:.1f} s", flush=True)
    base = rows[0][4]
    print("\n| variant | conversations | answer tokens | seconds | tokens/s | vs first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, convs, tokens, wall, rate in rows:
        print(f"| {name} | {convs} | {tokens} | {wall:.1f} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()

"""Build the datastore shipped for the bundled model beside its accelerators.

    python -m scripts.build_datastore [--seconds 600] [--quant bf16]

Its documents are the model's own answers to the seed prompts: the self-distilled data file
of the bundled model when one is on disk (what the shipped accelerators were trained on),
else answers generated now (greedy first, then sampled, as the trainer does) for up to
--seconds. Writes assets/accelerators/<fingerprint>-datastore/store.safetensors.
"""

from __future__ import annotations

import argparse
import time

from engine.config import ModelSpec
from engine.datastore.memory import Datastore
from engine.drafters.datastore_source import shipped_path
from engine.model.loading import load_model
from engine.paths import cache_dir
from trainer.seeds import DataBudget
from trainer.selfdistill import data_path, generate_data, load_conversations


def replies(lm, convs: list[list[dict]]) -> list[list[int]]:
    """The model's replies as token documents."""
    return [lm.tokenizer.encode(m["content"], add_special_tokens=False)
            for conv in convs for m in conv if m["role"] == "assistant"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="answering time when no self-distilled file is on disk")
    parser.add_argument("--quant", default="bf16")
    args = parser.parse_args()
    lm = load_model(ModelSpec(quant=args.quant))
    path = data_path(lm)
    if not path.is_file():
        path = cache_dir() / "datastore-build" / lm.fingerprint / "conversations.jsonl"
        budget = DataBudget(max_seconds=args.seconds)
        generate_data(lm, path, None, budget, lambda p: print(p.message, flush=True))
    docs = replies(lm, load_conversations(path))
    start = time.perf_counter()
    store = Datastore(lm.fingerprint)
    store.add_all(docs)
    out = shipped_path(lm.fingerprint)
    store.save(out)
    print(f"{out}: {len(docs)} replies, {store.tokens} tokens, "
          f"{out.stat().st_size / 1e6:.1f} MB, indexed in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()

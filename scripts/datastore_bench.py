"""Tokens per step of each method with and without the datastore, leave-one-out.

    python scripts/datastore_bench.py [--limit 24] [--quant bf16] [--tokens 128] [--out F]

The datastore for a measured prompt holds the shipped store (the model's answers to the
seed prompts, i.e. the training data) and the plain greedy replies to the *other* measured
prompts, never that prompt's own reply (leave-one-out). Greedy decoding; tokens per step is
independent of the machine's speed. "auto+datastore" is Auto that drafts the datastore's
tree instead of its arm where the store's match is long and confident (what the composed
drafters will decide per step); "datastore+lookup" copies while a 3-gram match holds and
drafts from the store otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.benchmark.prompts import DEFAULT_PROMPTS, encode_prompt, load_prompts, round_robin  # noqa: E402,E501
from engine.config import ModelSpec, SamplingParams  # noqa: E402
from engine.datastore import Datastore, load  # noqa: E402
from engine.drafters.auto import COPY, AutoDrafter  # noqa: E402
from engine.drafters.base import Draft  # noqa: E402
from engine.drafters.datastore import DatastoreDrafter, shipped_path, tree_draft  # noqa: E402
from engine.drafters.lookup import LookupDrafter, LookupParams, LookupSource  # noqa: E402
from engine.drafters.registry import load_auto  # noqa: E402
from engine.generate import run  # noqa: E402
from engine.loading import load_model  # noqa: E402

MIN_MATCH, MIN_PROB = 3, 0.5  # a store match Auto trusts over its arm


class AutoWithStore(AutoDrafter):
    """Auto, drafting the store's tree (a whole-model round, like copying) where it trusts it."""

    def __init__(self, auto: AutoDrafter, store: Datastore):
        self.__dict__.update(auto.__dict__)
        self.store, self._trees = store, {}

    def propose(self, state) -> Draft:
        chain, n = self.source.match(state.ids, state.room)
        if not (chain and self.source.copying(n)):
            found = self.store.continuations(state.ids, max_depth=state.room)
            if found.match_len >= MIN_MATCH and found.probs and found.probs[0] >= MIN_PROB:
                self._round = COPY
                return tree_draft(state.ids[-1], found, self._trees)
        return super().propose(state)


class StoreWithLookup(DatastoreDrafter):
    def __init__(self, store: Datastore):
        super().__init__(store)
        self.lookup = LookupSource(LookupParams())

    def start(self, state, prefill) -> None:
        super().start(state, prefill)
        self.lookup.reset()

    def propose(self, state) -> Draft:
        chain, n = self.lookup.match(state.ids, state.room)
        if chain and self.lookup.copying(n):
            return Draft.chain(state.ids[-1], chain)
        return super().propose(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model(ModelSpec(quant=args.quant))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)
    prompts = round_robin(load_prompts(DEFAULT_PROMPTS), args.limit)
    ids = [encode_prompt(lm, p, args.tokens) for p in prompts]
    shipped = load(shipped_path(lm.fingerprint), lm.fingerprint)
    plain = [run(lm, p, params)[1] for p in ids]
    auto = load_auto(lm)
    rows: dict[str, list[dict]] = {}
    for i, (prompt, p_ids) in enumerate(zip(prompts, ids)):
        store = Datastore(lm.fingerprint)
        store.add_all([*shipped.docs, *(r for j, r in enumerate(plain) if j != i)])
        methods = {"lookup": LookupDrafter(), "datastore": DatastoreDrafter(store),
                   "datastore+lookup": StoreWithLookup(store), "auto": auto,
                   "auto+datastore": AutoWithStore(auto, store)}
        for name, drafter in methods.items():
            _t, out, stats = run(lm, p_ids, params, drafter)
            rows.setdefault(name, []).append({
                "category": prompt.category, "tokens_per_step": stats.mean_accepted,
                "same": out == plain[i]})
        print(i, prompt.category, {k: round(v[-1]["tokens_per_step"], 2)
                                   for k, v in rows.items()}, flush=True)
    report = {name: summary(r) for name, r in rows.items()}
    report["_settings"] = {"prompts": len(prompts), "quant": args.quant, "tokens": args.tokens,
                           "shipped_store_tokens": shipped.tokens,
                           "rule": "leave-one-out: the measured prompt's own reply is "
                                   "never in its datastore"}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


def summary(rows: list[dict]) -> dict:
    cats = sorted({r["category"] for r in rows})
    mean = lambda rs: round(statistics.mean(r["tokens_per_step"] for r in rs), 3)  # noqa: E731
    return {"tokens_per_step": mean(rows), "greedy_match_rate":
            round(sum(r["same"] for r in rows) / len(rows), 3),
            "by_category": {c: mean([r for r in rows if r["category"] == c]) for c in cats}}


if __name__ == "__main__":
    main()

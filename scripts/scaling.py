"""What more self-distilled data buys: held-out acceptance against training tokens.

    python scripts/scaling.py [--data FILE] [--fractions 0.125,0.25,0.5,1] [--epochs 4]
                              [--drafters medusa,kangaroo] [--exit-layer 2]
                              [--out docs/scaling]

Trains Medusa heads and a Kangaroo adapter on growing prefixes of one self-distilled data
file (the one `python launcher.py train` wrote for the bundled model, unless --data names
another) for the same number of epochs each, and measures on the same held-out
conversations every head's top-1 (the share of positions where the head's first guess is
the model's own next token) and the adapter's agreement (the same share for its draft at
--exit-layer). Writes scaling.json and scaling.png into --out and prints a table. Run it
alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from engine.config import ModelSpec  # noqa: E402
from engine.drafters.kangaroo import Adapter  # noqa: E402
from engine.drafters.kangaroo_adapter import draft_head  # noqa: E402
from engine.loading import load_model  # noqa: E402
from trainer.features import encode_conversations, hidden_states  # noqa: E402
from trainer.kangaroo.train import KangarooTrainConfig  # noqa: E402
from trainer.medusa.train import MedusaTrainConfig  # noqa: E402
from trainer.selfdistill import data_path, split_heldout  # noqa: E402
from trainer.train import TrainConfig  # noqa: E402
from trainer.vocab import draft_vocabulary  # noqa: E402

# the modules (trainer.medusa and .kangaroo re-export train() under the same name)
medusa = importlib.import_module("trainer.medusa.train")
kangaroo = importlib.import_module("trainer.kangaroo.train")
HELDOUT_FRACTION = 0.06  # the pipeline's own split, so figures compare with `train`'s
# The Kangaroo trainer's layers: features kept at all of them reuse the cache a Kangaroo run
# wrote for the same data (a forward costs the same whatever layers it keeps).
CACHED_LAYERS = KangarooTrainConfig().exit_layers


def model_and_data(data: Path | None):
    """The bundled model, its self-distilled data file (or `data`), and the file's
    conversations split into train and held-out as `train` splits them."""
    lm = load_model(ModelSpec())
    path = data or data_path(lm)
    return lm, path, *split_heldout(path, HELDOUT_FRACTION)


def shared_features(lm, convs, layers: list[int]):
    """Features at `layers`, computed (or read from the cache) with the Kangaroo layers."""
    final = int(lm.model.config.num_hidden_layers)
    ids, masks = encode_conversations(lm, convs)
    return hidden_states(lm, ids, sorted({*CACHED_LAYERS, final, *layers}), masks).load(layers)


def medusa_point(lm, train_convs, heldout, config: MedusaTrainConfig, epochs: int) -> dict:
    """Heads trained on `train_convs` for `epochs` epochs: tokens and held-out top-1s."""
    final = int(lm.model.config.num_hidden_layers)
    feats = shared_features(lm, train_convs, [final])
    teacher = medusa.teacher_topk(lm, feats.states[final], config.teacher_topk)
    h_feats, h_teacher = heldout
    heads = medusa.new_heads(lm, config, feats, teacher)
    start = time.perf_counter()
    fit = medusa.fit_heads(lm, heads, (feats, teacher), heldout, config,
                           TrainConfig(epochs=epochs))
    h_pos, h_valid = medusa.positions(h_feats, config.num_heads)
    acc = medusa.head_accuracies(lm, heads, medusa.head_inputs(lm, h_feats, heads), h_teacher,
                                 h_pos, h_valid, 5)
    return {"conversations": len(train_convs), "tokens": int(feats.mask.sum()),
            "top1": [row[0] for row in acc], "top5": [row[4] for row in acc],
            "steps": fit["steps"], "train_s": round(time.perf_counter() - start, 1)}


def kangaroo_point(lm, train_convs, heldout, config: KangarooTrainConfig, exit_layer: int,
                   epochs: int) -> dict:
    """An adapter at `exit_layer` trained on `train_convs` for `epochs` epochs, as the
    trainer builds it: tokens and held-out agreement."""
    final = int(lm.model.config.num_hidden_layers)
    feats = shared_features(lm, train_convs, [exit_layer, final])
    vocab_size = lm.model.get_output_embeddings().weight.shape[0]
    rows = kangaroo.fitting_vocab(lm.model, config.draft_vocab, config.max_memory_share)
    vocab = draft_vocabulary(feats, rows, lm.eos_ids, vocab_size)
    head = draft_head(lm.model, vocab).float()
    source = kangaroo.source_layer(lm.model, exit_layer, config.init)
    adapter = Adapter.from_model(lm.model, source, torch.float32)
    start = time.perf_counter()
    fit = kangaroo.fit_adapter(lm, adapter, head, vocab, (feats, heldout), exit_layer, config,
                               TrainConfig(lr=config.lr, epochs=epochs))
    return {"conversations": len(train_convs), "tokens": int(feats.mask.sum()),
            "agreement": fit["agreement"], "steps": fit["steps"],
            "train_s": round(time.perf_counter() - start, 1)}


def plot(results: dict, path: Path) -> None:
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points = results.get("medusa", [])
    for k in range(len(points[0]["top1"]) if points else 0):
        ax.plot([p["tokens"] for p in points], [p["top1"][k] for p in points], marker="o",
                label=f"Medusa head {k + 1} top-1")
    if points := results.get("kangaroo"):
        ax.plot([p["tokens"] for p in points], [p["agreement"] for p in points], marker="s",
                color="black", label=f"Kangaroo agreement (exit layer {results['exit_layer']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("self-distilled answer tokens trained on")
    ax.set_ylabel("held-out top-1 (guess = model's next token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--drafters", default="medusa,kangaroo")
    parser.add_argument("--exit-layer", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/scaling"))
    args = parser.parse_args()
    lm, path, train_convs, heldout_convs = model_and_data(args.data)
    final = int(lm.model.config.num_hidden_layers)
    fractions = [float(f) for f in args.fractions.split(",")]
    subsets = [train_convs[: max(2, round(f * len(train_convs)))] for f in fractions]
    results = {"model": lm.model_id, "quant": lm.quant, "data": str(path),
               "epochs": args.epochs, "heldout_conversations": len(heldout_convs),
               "exit_layer": args.exit_layer}
    if "medusa" in args.drafters:
        config = dataclasses.replace(MedusaTrainConfig(), epochs=args.epochs)
        h_feats = shared_features(lm, heldout_convs, [final])
        heldout = (h_feats, medusa.teacher_topk(lm, h_feats.states[final], config.teacher_topk))
        results["medusa"] = []
        for subset in subsets:
            p = medusa_point(lm, subset, heldout, config, args.epochs)
            results["medusa"].append(p)
            print(f"medusa {p['tokens']:>7} tokens ({p['conversations']} conversations): top-1 "
                  + " / ".join(f"{a:.3f}" for a in p["top1"]), flush=True)
    if "kangaroo" in args.drafters:
        config = KangarooTrainConfig()
        heldout = shared_features(lm, heldout_convs, [args.exit_layer, final])
        results["kangaroo"] = []
        for subset in subsets:
            p = kangaroo_point(lm, subset, heldout, config, args.exit_layer, args.epochs)
            results["kangaroo"].append(p)
            print(f"kangaroo {p['tokens']:>7} tokens ({p['conversations']} conversations): "
                  f"agreement {p['agreement']:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "scaling.png")
    print(f"wrote {args.out / 'scaling.json'} and {args.out / 'scaling.png'}")


if __name__ == "__main__":
    main()

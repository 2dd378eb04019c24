"""What more self-distilled data buys: held-out acceptance against training tokens.

    python scripts/scaling.py [--data FILE] [--fractions 0.125,0.25,0.5,1] [--epochs 4]
                              [--out docs/scaling]

Trains Medusa heads on growing prefixes of one self-distilled data file (the one
`python launcher.py train` wrote for the bundled model, unless --data names another) for
the same number of epochs each, and measures on the same held-out conversations every
head's top-1 (the share of positions where the head's first guess is the model's own next
token). Writes scaling.json and scaling.png into --out and prints a table. Run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from engine.config import ModelSpec  # noqa: E402
from engine.loading import load_model  # noqa: E402
from trainer.medusa import MedusaTrainConfig  # noqa: E402
from trainer.selfdistill import data_path, split_heldout  # noqa: E402
from trainer.train import TrainConfig  # noqa: E402

# the module (trainer.medusa re-exports its train() function under the same name)
medusa = importlib.import_module("trainer.medusa.train")
HELDOUT_FRACTION = 0.06  # the pipeline's own split, so figures compare with `train`'s


def medusa_point(lm, train_convs, heldout, config: MedusaTrainConfig, epochs: int) -> dict:
    """Heads trained on `train_convs` for `epochs` epochs: tokens and held-out top-1s."""
    final = int(lm.model.config.num_hidden_layers)
    feats = medusa.features_for(lm, train_convs, [final])
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


def plot(points: list[dict], path: Path) -> None:
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tokens = [p["tokens"] for p in points]
    for k in range(len(points[0]["top1"])):
        ax.plot(tokens, [p["top1"][k] for p in points], marker="o", label=f"Medusa head {k + 1}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("self-distilled answer tokens trained on")
    ax.set_ylabel("held-out top-1 (guess = model's next token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("docs/scaling"))
    args = parser.parse_args()
    lm = load_model(ModelSpec())
    path = args.data or data_path(lm)
    train_convs, heldout_convs = split_heldout(path, HELDOUT_FRACTION)
    config = dataclasses.replace(MedusaTrainConfig(), epochs=args.epochs)
    final = int(lm.model.config.num_hidden_layers)
    h_feats = medusa.features_for(lm, heldout_convs, [final])
    heldout = (h_feats, medusa.teacher_topk(lm, h_feats.states[final], config.teacher_topk))
    points = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        subset = train_convs[: max(2, round(fraction * len(train_convs)))]
        points.append(medusa_point(lm, subset, heldout, config, args.epochs))
        p = points[-1]
        print(f"{p['tokens']:>7} tokens ({p['conversations']} conversations): top-1 "
              + " / ".join(f"{a:.3f}" for a in p["top1"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(
        {"model": lm.model_id, "quant": lm.quant, "data": str(path), "epochs": args.epochs,
         "heldout_conversations": len(heldout_convs), "medusa": points}, indent=1))
    plot(points, args.out / "scaling.png")
    print(f"wrote {args.out / 'scaling.json'} and {args.out / 'scaling.png'}")


if __name__ == "__main__":
    main()

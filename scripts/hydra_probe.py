"""Would Hydra-style heads pay? Held-out top-1 chains of today's heads against heads that
also read the tokens along the path.

    python scripts/hydra_probe.py [--data FILE] [--epochs 3] [--out docs/bench/hydra]

Today head k reads the final state h_t and the pending token t + 1. A Hydra-style head k
reads the token t + k instead: the candidate of head k - 1 on the tree path it extends
(head 1 is unchanged). Both kinds are trained on the same self-distilled data (the bundled
model's, unless --data names another) for the same epochs, and measured on the held-out
conversations answered greedily, where the data's next token is the model's own choice:
there, teacher-forcing head k with token t + k is exactly what the tree would feed it
after accepting heads 1..k-1. Reported per head: top-1 given every earlier head was right
(the chance the path grows by one more token), and the mean length of the correct top-1
chain (tokens a top-1 chain adds per step). Run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# scripts/ itself is on sys.path when this runs as a script
from scaling import HELDOUT_FRACTION, model_and_data, shared_features  # noqa: E402

from engine.drafters.medusa import MedusaHeads, pending_inputs  # noqa: E402
from trainer.medusa.train import MedusaTrainConfig  # noqa: E402
from trainer.selfdistill import split_heldout  # noqa: E402
from trainer.train import TrainConfig  # noqa: E402

medusa = importlib.import_module("trainer.medusa.train")
_today_inputs = medusa.head_inputs
HEADS = MedusaTrainConfig().num_heads


class HydraHeads(MedusaHeads):
    """Head k reads its own token: pending (..., K, H), row k the embedding of token t + k."""

    def transform(self, hidden: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        z = torch.einsum("...i,koi->...ko", hidden, self.weight) + self.bias
        low = pending.to(z.dtype) @ self.token_down.T  # (..., K, r)
        z = z + torch.einsum("...kr,kor->...ko", low, self.token_up)
        return hidden.unsqueeze(-2) + torch.nn.functional.silu(z)


@dataclasses.dataclass
class HydraInputs(medusa.HeadInputs):
    """Teacher-forced path tokens: what the tree feeds head k once heads 1..k-1 are right."""

    def at(self, pos: torch.Tensor, device):
        ks = torch.arange(1, HEADS + 1)  # head k reads token t + k
        tokens = (pos.unsqueeze(-1) + ks).clamp(max=self.ids.numel() - 1)  # masked past the end
        rows = pending_inputs(self.embedding, self.ids[tokens].to(self.embedding.device))
        return self.states[pos].to(device), rows.to(device)


def head_inputs(lm, feats, heads):
    inputs = _today_inputs(lm, feats, heads)
    return HydraInputs(inputs.states, inputs.ids, inputs.embedding) if isinstance(
        heads, HydraHeads) else inputs


medusa.head_inputs = head_inputs  # fit_heads and head_accuracies read the heads' own inputs


def chains(lm, heads, feats, teacher) -> dict:
    """Per head, top-1 given heads 1..k-1 were right, and the mean correct chain length."""
    pos, valid = medusa.positions(feats, HEADS)
    projection = heads.project(lm.model.get_output_embeddings().weight.detach())
    inputs = head_inputs(lm, feats, heads)
    right = []
    with torch.inference_mode():
        for start in range(0, pos.numel(), 512):
            p, v = pos[start:start + 512], valid[start:start + 512]
            states, pending = inputs.at(p, lm.device)
            guess = heads.tokens(heads.logits(states, pending, projection).argmax(-1)).cpu()
            target = teacher.ids[(p.unsqueeze(-1) + torch.arange(1, HEADS + 1)).clamp(
                max=teacher.ids.shape[0] - 1), 0]  # (B, K) the model's own tokens
            right.append((guess == target) & v)
    path = torch.cat(right).cumprod(-1)  # (P, K): heads 1..k all right
    given = [float(path[:, k].sum() / path[:, k - 1].sum().clamp_min(1)) if k else
             float(path[:, 0].float().mean()) for k in range(HEADS)]
    return {"top1_given_path": [round(g, 4) for g in given],
            "mean_chain": round(float(path.sum(-1).float().mean()), 4),
            "positions": int(pos.numel())}


def greedy_heldout(path: Path) -> list[list[dict]]:
    """Held-out conversations of the greedy pass (keys ending in #0)."""
    with tempfile.TemporaryDirectory() as folder:
        greedy = Path(folder) / "greedy.jsonl"
        greedy.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                                  if json.loads(line).get("key", "").endswith("#0")))
        return split_heldout(greedy, HELDOUT_FRACTION)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/hydra"))
    args = parser.parse_args()
    lm, path, train_convs, heldout_convs = model_and_data(args.data)
    final = int(lm.model.config.num_hidden_layers)
    config = dataclasses.replace(MedusaTrainConfig(), epochs=args.epochs)
    feats = shared_features(lm, train_convs, [final])
    teacher = medusa.teacher_topk(lm, feats.states[final], config.teacher_topk)
    h_feats = shared_features(lm, heldout_convs, [final])
    h_teacher = medusa.teacher_topk(lm, h_feats.states[final], config.teacher_topk)
    g_feats = shared_features(lm, greedy_heldout(path), [final])
    g_teacher = medusa.teacher_topk(lm, g_feats.states[final], config.teacher_topk)
    results = {"model": lm.model_id, "quant": lm.quant, "data": str(path),
               "epochs": args.epochs, "train_tokens": int(feats.mask.sum())}
    for name, kind in (("today", MedusaHeads), ("hydra", HydraHeads)):
        heads = medusa.new_heads(lm, config, feats, teacher)
        heads = kind(heads.weight.shape[-1], heads.settings, heads.vocab_ids)
        fit = medusa.fit_heads(lm, heads, (feats, teacher), (h_feats, h_teacher), config,
                               TrainConfig(epochs=args.epochs))
        results[name] = {**chains(lm, heads, g_feats, g_teacher), "train_s": fit["seconds"]}
        print(name, json.dumps(results[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hydra.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out / 'hydra.json'}")


if __name__ == "__main__":
    main()

"""Medusa-1 training on cached final hidden states (the backbone stays frozen).

Head k at position t reads the state at t and the token at t + 1 (the pending token the
state predicted, known when the drafter runs) and learns the base model's own distribution
at position t + k, i.e. over token t + k + 1 (soft targets, Medusa §2.2.1 with
self-distillation), loss weights 0.8^k. The full-vocabulary softmax would dominate the
cost on a CPU, so each step scores a sampled softmax: the teacher's top-k tokens of every
target in the batch plus random negatives. The teacher's top-k come once from the cached
states through the frozen LM head.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from engine.drafters.medusa import MedusaHeads, MedusaSettings, pending_inputs
from engine.drafters.payoff import machine
from engine.progress import Progress, ProgressFn, ignore
from trainer.context import prompt_ids
from trainer.features import Features, forward_seconds_per_token
from trainer.losses import candidate_columns, head_weights, sparse_soft_cross_entropy
from trainer.medusa.calibrate_tree import calibrate, ranked_hits
from trainer.recorded import features_for
from trainer.resume import start_from
from trainer.training_loop import TrainConfig, train_module
from trainer.vocab import coverage, draft_vocabulary

CHUNK = 2048  # positions per LM-head matmul when scoring teachers and accuracies


@dataclass(frozen=True)
class MedusaTrainConfig:
    """What the Medusa trainer builds and how it scores each step."""

    num_heads: int = 4  # K heads: head k guesses the token k + 1 positions ahead
    pending_rank: int = 128  # rank of the heads' pending-token path (MedusaSettings); 0 = off
    own_vocab: bool = False  # a (V, H) projection per head instead of the shared LM head
    draft_vocab: int = 8192  # heads propose only the N most frequent answer tokens; 0 = all
    # (ignored with own_vocab, whose projections cover the whole vocabulary)
    teacher_topk: int = 16  # teacher tokens kept per position (the soft target's support)
    negatives: int = 1024  # random extra vocabulary columns per step
    batch_positions: int = 512  # training positions per step
    eval_positions: int = 2048  # held-out positions per evaluation
    max_rank: int = 10  # per-head top-i accuracies measured for i = 1..max_rank
    epochs: int = 30  # upper bound: the time budget usually ends training first (the best
    # held-out weights are kept, so extra epochs on little data cannot overfit the result)
    seed: int = 0  # batch order and negatives


@dataclass
class Teacher:
    """The base model's top-k next-token guesses at every cached position."""

    ids: torch.Tensor  # (T, k) long
    logits: torch.Tensor  # (T, k) float32, same order


def teacher_of(lm, feats: Features, k: int, progress: ProgressFn = ignore) -> Teacher:
    """The top-k next-token logits at every position of `feats`: as the data stage recorded
    them where it did, the rest through the frozen LM head."""
    final = int(lm.model.config.num_hidden_layers)
    recorded = feats.recorded
    if recorded is None or feats.top_ids.shape[1] < k:
        return teacher_topk(lm, feats.states[final], k, progress)
    ids, logits = feats.top_ids[:, :k].long(), feats.top_logits[:, :k].float()
    if not bool(recorded.all()):
        rest = teacher_topk(lm, feats.states[final][~recorded], k, progress)
        ids[~recorded], logits[~recorded] = rest.ids, rest.logits
    return Teacher(ids, logits)


def teacher_topk(lm, states: torch.Tensor, k: int, progress: ProgressFn = ignore) -> Teacher:
    """Top-k of the frozen LM head over (T, H) final states, in chunks."""
    head = lm.model.get_output_embeddings()
    ids, logits = [], []
    for start in range(0, states.shape[0], CHUNK):
        with torch.inference_mode():
            out = head(states[start : start + CHUNK].to(lm.device, lm.dtype)).float()
            top = out.topk(k, dim=-1)
        ids.append(top.indices.cpu())
        logits.append(top.values.cpu())
        done = min(start + CHUNK, states.shape[0])
        progress(Progress("features", done, states.shape[0], "teacher distributions"))
    return Teacher(torch.cat(ids), torch.cat(logits))


@dataclass
class HeadInputs:
    """What the heads read at cached positions: final states, and the pending tokens'
    embeddings for heads that see them."""

    states: torch.Tensor  # (T, H) final states
    ids: torch.Tensor  # (T,) token ids
    embedding: torch.nn.Module | None  # the model's input embeddings; None: hidden state only
    model_device: torch.device  # where the model (and its embeddings) run

    def at(self, pos: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B,) positions -> (B, H) states and (B, H) pending_inputs of token t + 1, the
        token state t predicted (positions() only yields t with t + 1 in the sequence)."""
        states = self.states[pos].to(device)
        if self.embedding is None:
            return states, None
        tokens = self.ids[pos + 1].to(self.model_device)
        return states, pending_inputs(self.embedding, tokens).to(device)


def head_inputs(lm, feats: Features, heads: MedusaHeads) -> HeadInputs:
    """What `heads` read from these features (the model's own input embeddings)."""
    final = int(lm.model.config.num_hidden_layers)
    embedding = lm.model.get_input_embeddings() if heads.settings.pending_rank else None
    return HeadInputs(feats.states[final], feats.ids, embedding, lm.device)


def positions(features: Features, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training positions and their per-head validity.

    Position t is used when token t + 1 belongs to an answer (the state then predicts answer
    text, as at decode time). Returns (P,) long positions and (P, K) bool: head k has a
    target when t + k is still inside the same conversation.
    """
    total = features.tokens
    conv_end = features.offsets[1:].repeat_interleave(features.offsets.diff())  # (T,)
    nxt = torch.zeros(total, dtype=torch.bool)
    nxt[:-1] = features.mask[1:]
    nxt &= torch.arange(total) + 1 < conv_end
    pos = nxt.nonzero().squeeze(-1)
    ks = torch.arange(1, num_heads + 1)
    valid = pos.unsqueeze(-1) + ks < conv_end[pos].unsqueeze(-1)
    return pos, valid


def step_loss(heads: MedusaHeads, weight: torch.Tensor, inputs: HeadInputs, teacher: Teacher,
              pos: torch.Tensor, valid: torch.Tensor, config: MedusaTrainConfig,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Weighted sampled-softmax soft cross-entropy of all heads for a batch of positions.

    weight: (V, H) frozen vocabulary projection; pos: (B,); valid: (B, K).
    """
    k_heads = heads.settings.num_heads
    targets = pos.unsqueeze(-1) + torch.arange(1, k_heads + 1)  # (B, K) teacher positions
    targets = torch.where(valid, targets, pos.unsqueeze(-1))  # masked out below
    t_ids, t_logits = teacher.ids[targets], teacher.logits[targets]  # (B, K, k)
    cols = candidate_columns(t_ids, weight.shape[0], config.negatives, generator)  # (C,)
    where = torch.searchsorted(cols, t_ids)  # (B, K, k): teacher tokens' scored columns
    dev = heads.weight.device
    cols, where, t_logits, valid = cols.to(dev), where.to(dev), t_logits.to(dev), valid.to(dev)
    # bf16 matmuls (fp32 master weights, fp32 softmax): ~4x faster on CPUs with bf16 units.
    states, pending = inputs.at(pos, dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        hidden = heads.transform(states, pending)  # (B, K, H)
        if heads.vocab is None:
            student = (hidden.flatten(0, 1) @ weight[cols].T).unflatten(0, hidden.shape[:2])
        else:
            student = torch.einsum("bkh,kch->bkc", hidden, heads.vocab[:, cols])  # (B, K, C)
    losses = sparse_soft_cross_entropy(student, where, t_logits)  # (B, K)
    per_head = (losses * valid).sum(0) / valid.sum(0).clamp_min(1)  # (K,)
    lam = torch.tensor(head_weights(k_heads), device=dev)
    return (lam * per_head).sum() / lam.sum()


def head_accuracies(lm, heads: MedusaHeads, inputs: HeadInputs, teacher: Teacher,
                    pos: torch.Tensor, valid: torch.Tensor, max_rank: int) -> list[list[float]]:
    """Per head, top-i accuracy (i = 1..max_rank) against the base model's greedy token at
    t + k, guessing from the heads' vocabulary as the drafter does. Returns K lists of
    cumulative accuracies."""
    k_heads = heads.settings.num_heads
    hits, counts = torch.zeros(k_heads, max_rank), torch.zeros(k_heads)
    for at, right in ranked_hits(lm, heads, inputs, teacher, pos, k_heads, max_rank,
                                 CHUNK // k_heads):
        hits += (right & valid[at].unsqueeze(-1)).sum(0)  # (K, R) hits where head k has a target
        counts += valid[at].sum(0)
    cumulative = hits.cumsum(-1) / counts.clamp_min(1).unsqueeze(-1)
    return [[round(float(a), 4) for a in row] for row in cumulative]


def check(lm) -> None:
    """Refuse a model Medusa cannot train on: none (the heads read only the final state
    and the input embeddings)."""


def reserve_s(options) -> float:
    """Seconds of the budget kept back from training for calibration."""
    return options.calibration_seconds


def feature_layers(lm, options) -> tuple[int, ...]:
    """The hidden-state layers the heads learn from (the final normed state)."""
    return (int(lm.model.config.num_hidden_layers),)


def prep_seconds_per_token(lm, options) -> float:
    """Seconds the stages between data and training (features, teacher) spend per stored
    conversation token on this machine: a timed feature forward plus a timed teacher chunk."""
    hidden = int(lm.model.get_output_embeddings().weight.shape[1])
    states = torch.randn(CHUNK, hidden, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    teacher_topk(lm, states, options.medusa.teacher_topk)
    return forward_seconds_per_token(lm) + (time.perf_counter() - start) / CHUNK


def train(lm, train_convs: list[list[dict]], heldout_convs: list[list[dict]], options,
          progress: ProgressFn = ignore, cancel: threading.Event | None = None
          ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Features -> heads -> held-out accuracies -> calibrated tree, within
    options.max_minutes (the time the pipeline left for these stages).

    Returns (checkpoint tensors, settings for drafter.json, metrics for metrics.json).
    """
    config: MedusaTrainConfig = options.medusa
    start = time.perf_counter()
    final = int(lm.model.config.num_hidden_layers)
    train = features_for(lm, train_convs, [final], progress, cancel)
    heldout = features_for(lm, heldout_convs, [final], progress, cancel)
    times = {"features_s": round(time.perf_counter() - start, 1)}
    mark = time.perf_counter()
    t_teacher = teacher_of(lm, train, config.teacher_topk, progress)
    h_teacher = teacher_of(lm, heldout, config.teacher_topk)
    times["teacher_s"] = round(time.perf_counter() - mark, 1)
    heads = new_heads(lm, config, train, t_teacher)
    # Retrain: the stored heads, if they fit; shared-LM-head heads keep the new vocabulary
    start_from(heads, options, progress, "heads.", fresh=() if config.own_vocab else ("vocab_ids",))
    left = options.max_minutes * 60 - (time.perf_counter() - start)
    budget = max(10.0, left - options.calibration_seconds)
    train_config = dataclasses.replace(options.train, epochs=config.epochs, max_seconds=budget)
    mark = time.perf_counter()
    fit = fit_heads(lm, heads, (train, t_teacher), (heldout, h_teacher), config, train_config,
                    progress, cancel)
    times["train_s"] = round(time.perf_counter() - mark, 1)
    if cancel is not None and cancel.is_set():
        return heads.tensors(), {}, {"train": fit, "times": times}  # the pipeline saves nothing
    mark = time.perf_counter()
    h_pos, h_valid = positions(heldout, config.num_heads)
    h_inputs = head_inputs(lm, heldout, heads)
    acc = head_accuracies(lm, heads, h_inputs, h_teacher, h_pos, h_valid, config.max_rank)
    prompts = [prompt_ids(lm, conv) for conv in heldout_convs if len(conv) >= 2]
    result = calibrate(lm, heads, acc, h_inputs, h_teacher, h_pos, h_valid, prompts,
                       options.calibration, progress, cancel, options.calibration_seconds)
    times["calibrate_s"] = round(time.perf_counter() - mark, 1)
    settings = {**heads.settings.to_json(), "candidates": result.candidates,
                "pays": result.pays_off, "quant": lm.quant, "device": lm.device.type,
                "machine": machine(lm),
                "accuracies": acc}  # held-out top-i accuracies per head, for people
    metrics = _metrics(acc, result, fit, heads, train, heldout, times)
    return heads.tensors(), settings, metrics


def new_heads(lm, config: MedusaTrainConfig, train: Features, teacher: Teacher) -> MedusaHeads:
    """Untrained heads (W = 0) over the draft vocabulary chosen from the training data.
    Own projections are trained over the whole vocabulary, so they get all of it."""
    weight = lm.model.get_output_embeddings().weight.detach()
    size = 0 if config.own_vocab else config.draft_vocab
    # The model's own top guesses at answer positions count as well as what it said.
    vocab = draft_vocabulary(train, size, (), len(weight), extra=teacher.ids[train.mask, 0])
    settings = MedusaSettings(config.num_heads, config.own_vocab, config.pending_rank)
    return MedusaHeads(int(lm.model.config.hidden_size), settings, vocab,
                       weight if config.own_vocab else None)


def _metrics(acc, result, fit: dict, heads: MedusaHeads, train: Features, heldout: Features,
             times: dict) -> dict:
    """metrics.json: held-out accuracies, training and calibration figures, stage times."""
    drafted = result.measured.get("medusa", {})
    return {
        "topk_accuracy": {f"head{k + 1}": row for k, row in enumerate(acc)},
        "top1": [row[0] for row in acc],
        "top5": [row[min(4, len(row) - 1)] for row in acc],
        # decoding with the heads as measured here against plain decoding
        "speedup": drafted.get("speedup", 1.0),
        "mean_accepted": drafted.get("mean_accepted", 1.0),
        "train": fit,
        "calibration": {"chosen": result.chosen, "measured": result.measured,
                        "candidates": len(result.candidates)},
        "draft_vocab": {"size": None if heads.vocab_ids is None else int(heads.vocab_ids.numel()),
                        "heldout_coverage": coverage(heldout, heads.vocab_ids)},
        "train_tokens": train.tokens, "heldout_tokens": heldout.tokens, "times": times,
    }


def fit_heads(lm, heads: MedusaHeads, train: tuple[Features, Teacher],
              heldout: tuple[Features, Teacher], config: MedusaTrainConfig,
              train_config: TrainConfig, progress: ProgressFn = ignore,
              cancel: threading.Event | None = None) -> dict:
    """Train the heads on cached features with the shared loop; returns its figures."""
    feats, teacher = train
    inputs = head_inputs(lm, feats, heads)
    pos, valid = positions(feats, config.num_heads)
    weight = lm.model.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(config.seed)

    def batches(epoch: int) -> list[torch.Tensor]:
        order = torch.randperm(pos.numel(), generator=gen)
        return list(order.split(config.batch_positions))

    def loss_fn(module: MedusaHeads, idx: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return step_loss(module, weight, inputs, teacher, pos[idx], valid[idx], config, gen), {}

    h_feats, h_teacher = heldout
    h_inputs = head_inputs(lm, h_feats, heads)
    h_pos, h_valid = positions(h_feats, config.num_heads)
    pick = torch.randperm(h_pos.numel(), generator=torch.Generator().manual_seed(config.seed))
    pick = pick[: config.eval_positions]

    def eval_fn(module: MedusaHeads) -> tuple[float, dict]:
        """Minus the heads' weighted held-out top-1 accuracy (lower is better), and each
        head's top-1 for the progress line."""
        acc = head_accuracies(lm, module, h_inputs, h_teacher, h_pos[pick], h_valid[pick], 1)
        lam = head_weights(config.num_heads)
        loss = -sum(w * row[0] for w, row in zip(lam, acc, strict=True)) / sum(lam)
        return loss, {f"head {k + 1} top-1": row[0] for k, row in enumerate(acc)}

    heads.to(lm.device, torch.float32).train()
    return train_module(heads, batches, loss_fn, train_config, progress, cancel,
                        eval_fn if h_pos.numel() else None)


def summary_lines(m: dict, s: dict) -> list[str]:
    """What the trained heads do here, for people (the train command prints it)."""
    lines = ["held-out accuracy per head (top-1 / top-5):"]
    for k, (t1, t5) in enumerate(zip(m.get("top1", []), m.get("top5", []), strict=False), 1):
        lines.append(f"  head {k}: {t1 * 100:5.1f}% / {t5 * 100:5.1f}%")
    drafted = m.get("calibration", {}).get("measured", {}).get("medusa")
    if drafted and s.get("pays"):
        lines.append(f"measured {drafted['speedup']:.2f}x plain decoding here, "
                     f"{drafted['mean_accepted']:.2f} tokens per step")
    else:
        tried = f" (measured {drafted['speedup']:.2f}x)" if drafted else ""
        lines.append(f"The Medusa heads do not pay on this machine{tried}: each step drafts "
                     "only where the heads are expected to pay, else decodes plainly.")
    return lines

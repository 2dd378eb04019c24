"""Kangaroo training: the adapter (one decoder layer of the model's class, initialised from a
copy of one of its layers, and the final norm) learns the frozen model's own next-token
distribution from the states after the first l layers (soft cross-entropy against the full
model, Kangaroo §3.2), on cached features, for each exit layer tried; calibration then keeps
the exit layer, eta and gamma its cost model finds fastest here (trainer.kangaroo.calibrate_exit).

Drafting and training can use a reduced vocabulary: the tokens the model emits most in its
own self-distilled answers. Decoding stays lossless (verification reads the full
distribution); the draft head and the training softmax shrink by V / Vd.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.decode import split
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import draft_head, sequence_states
from engine.drafters.payoff import machine
from engine.errors import QuickdraftError
from engine.progress import Progress, ProgressFn, ignore
from trainer.context import padded, prompt_ids
from trainer.features import Features, forward_seconds_per_token
from trainer.kangaroo.calibrate_exit import KangarooCalibration, calibrate
from trainer.losses import soft_cross_entropy
from trainer.recorded import features_for
from trainer.resume import start_from
from trainer.training_loop import TrainConfig, train_module
from trainer.vocab import coverage, draft_vocabulary


@dataclass(frozen=True)
class KangarooTrainConfig:
    """What the Kangaroo trainer builds and how it batches."""

    exit_layers: tuple[int, ...] = (1, 2, 3)  # exits tried, one adapter each; calibration picks
    # the adapter starts as a copy of the model's last layer ("last") or of the layer right
    # after the exit ("next")
    init: str = "last"
    draft_vocab: int = 8192  # draft over the most frequent answer tokens; 0 = full vocabulary
    max_memory_share: float = 0.05  # adapter + copied head rows, as a share of the model's
    # weights; the draft vocabulary shrinks to fit
    max_len: int = 1024  # conversation tokens trained on (longer conversations are cut)
    batch_tokens: int = 4096  # padded tokens per training step
    eval_positions: int = 4096  # held-out positions per agreement evaluation
    lr: float = 2e-3  # AdamW peak learning rate (cosine schedule from options.train)
    epochs: int = 8  # passes over the cache per exit layer (the time budget may stop earlier)
    seed: int = 0  # batch order
    # the exit layer / eta / gamma sweep timed on this machine
    calibration: KangarooCalibration = field(default_factory=KangarooCalibration)


@dataclass
class Batch:
    """Padded conversations and where their loss positions are."""

    index: torch.Tensor  # (B, S) long: rows of the flat feature tensors; padding repeats row 0
    pad: torch.Tensor  # (B, S) long: 1 on real tokens (the 2-D attention mask)
    loss: torch.Tensor  # (B, S) bool: the next token belongs to an answer


def source_layer(model, exit_layer: int, init: str) -> int:
    """The decoder layer an adapter for `exit_layer` is initialised from."""
    if init not in ("last", "next"):
        raise QuickdraftError(f"unknown Kangaroo adapter init {init!r} (last or next)")
    return split.num_layers(model) - 1 if init == "last" else exit_layer


def fitting_vocab(model, wanted: int, share: float) -> int:
    """The largest draft vocabulary (<= wanted) whose copied LM-head rows, with the adapter,
    stay within `share` of the model's weight memory; 0 = the full vocabulary (no copy)."""
    if wanted <= 0:
        return 0
    head = model.get_output_embeddings().weight
    vocab_size, row_bytes = head.shape[0], head.shape[1] * head.element_size()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter = Adapter(model)  # every decoder layer has the same size
    adapter_bytes = sum(p.numel() for p in adapter.parameters()) * head.element_size()
    room = max(0, int((share * model_bytes - adapter_bytes) // row_bytes))
    return min(wanted, room, vocab_size)


def make_batches(feats: Features, max_len: int, batch_tokens: int) -> list[Batch]:
    """Conversations (cut to max_len) grouped by length into padded batches."""
    spans = []
    for c in range(feats.conversations):
        a = int(feats.offsets[c])
        b = min(int(feats.offsets[c + 1]), a + max_len)
        if b - a >= 2:
            spans.append((a, b))
    spans.sort(key=lambda s: s[1] - s[0])
    batches, group = [], []
    for span in spans:  # shortest first: the newest span is the batch's widest
        if group and (span[1] - span[0]) * (len(group) + 1) > batch_tokens:
            batches.append(_pad(feats, group))
            group = []
        group.append(span)
    return batches + ([_pad(feats, group)] if group else [])


def _pad(feats: Features, spans: list[tuple[int, int]]) -> Batch:
    index, pad = padded([list(range(a, b)) for a, b in spans])
    loss = torch.zeros(index.shape, dtype=torch.bool)
    for row, (a, b) in enumerate(spans):
        loss[row, : b - a - 1] = feats.mask[a + 1 : b]  # state t predicts token t + 1
    return Batch(index, pad, loss)


def batch_loss(model, adapter: Adapter, head: torch.Tensor, feats: Features, exit_layer: int,
               batch: Batch) -> torch.Tensor:
    """Soft cross-entropy of the draft against the model's own distribution over the draft
    vocabulary, on the batch's loss positions. head: (Vd, H) float32."""
    final = split.num_layers(model)
    x = feats.states[exit_layer][batch.index].float()  # (B, S, H)
    out = sequence_states(model, adapter, x, batch.pad)[batch.loss]  # (N, H)
    with torch.no_grad():  # the last state is final-normed: the LM head reads it as it is
        teacher = split.logits(model, feats.states[final][batch.index[batch.loss]].float(), head)
    return soft_cross_entropy(split.logits(model, out, head), teacher)  # (N, Vd) each


def model_choices(model, feats: Features, batches: list[Batch]) -> list[torch.Tensor]:
    """Per batch, (N,) the model's own first choice at each loss position (full vocabulary)."""
    final = split.num_layers(model)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        return [(feats.states[final][b.index[b.loss]].to(head.dtype) @ head.T).argmax(-1)
                for b in batches]


def agreement(model, adapter: Adapter, head: torch.Tensor, vocab: torch.Tensor | None,
              feats: Features, exit_layer: int, batches: list[Batch],
              targets: list[torch.Tensor]) -> float:
    """Top-1 agreement with the model: the share of loss positions where the draft's first
    choice (in its vocabulary) is the model's own (targets from model_choices)."""
    hits = total = 0
    with torch.no_grad():
        for batch, target in zip(batches, targets, strict=True):
            x = feats.states[exit_layer][batch.index].float()
            out = sequence_states(model, adapter, x, batch.pad)
            guess = (out[batch.loss] @ head.T).argmax(-1)
            guess = guess if vocab is None else vocab[guess]
            hits += int((guess == target).sum())
            total += guess.numel()
    return hits / max(1, total)


def _eval_batches(batches: list[Batch], positions: int) -> list[Batch]:
    """Batches spread evenly over the (length-sorted) list, about `positions` loss positions."""
    total = sum(int(b.loss.sum()) for b in batches)
    if total <= positions:
        return batches
    keep = positions / total  # share of the batches kept, every 1/keep-th one
    return [b for i, b in enumerate(batches) if int(i * keep) != int((i + 1) * keep)]


def fit_adapter(lm, adapter: Adapter, head: torch.Tensor, vocab, data: tuple[Features, Features],
                exit_layer: int, config: KangarooTrainConfig, train_config: TrainConfig,
                progress: ProgressFn = ignore, cancel: threading.Event | None = None) -> dict:
    """Train one adapter with the shared loop (best held-out agreement kept); its figures."""
    train, heldout = data
    batches = make_batches(train, config.max_len, config.batch_tokens)
    held = make_batches(heldout, config.max_len, config.batch_tokens)
    held = _eval_batches(held, config.eval_positions)
    targets = model_choices(lm.model, heldout, held)
    gen = torch.Generator().manual_seed(config.seed)

    def batches_fn(epoch: int) -> list[Batch]:
        return [batches[i] for i in torch.randperm(len(batches), generator=gen)]

    def loss_fn(module: Adapter, batch: Batch) -> tuple[torch.Tensor, dict]:
        return batch_loss(lm.model, module, head, train, exit_layer, batch), {}

    def eval_fn(module: Adapter) -> tuple[float, dict]:
        """Minus held-out agreement (lower is better), and agreement for the progress line."""
        share = agreement(lm.model, module, head, vocab, heldout, exit_layer, held, targets)
        return -share, {f"exit {exit_layer} agreement": share}

    adapter.to(torch.float32).train()
    fit = train_module(adapter, batches_fn, loss_fn, train_config, progress, cancel,
                       eval_fn if held else None)
    fit["agreement"] = round(-eval_fn(adapter)[0], 4) if held else 0.0
    return fit


def check(lm) -> None:
    """Refuse, before any data is spent, a model whose layers the engine cannot split."""
    split.check_supported(lm.model)


def reserve_s(options) -> float:
    """Seconds of the budget kept back from training for calibration."""
    return options.kangaroo.calibration.seconds


def feature_layers(lm, options) -> tuple[int, ...]:
    """The hidden-state layers the adapters learn from: each exit's and the final one."""
    return (*options.kangaroo.exit_layers, split.num_layers(lm.model))


def prep_seconds_per_token(lm, options) -> float:
    """Seconds the features stage spends per stored conversation token on this machine."""
    return forward_seconds_per_token(lm)


def train(lm, train_convs: list[list[dict]], heldout_convs: list[list[dict]], options,
          progress: ProgressFn = ignore, cancel: threading.Event | None = None
          ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Features -> one adapter per exit layer -> calibrated (l, eta, gamma), within
    options.max_minutes. Returns (checkpoint tensors, drafter.json settings, metrics)."""
    check(lm)
    config: KangarooTrainConfig = options.kangaroo
    start = time.perf_counter()
    final = split.num_layers(lm.model)
    exits = sorted({e for e in config.exit_layers if 1 <= e < final})
    if not exits:
        raise QuickdraftError(f"no usable Kangaroo exit layer in {config.exit_layers} (the model "
                              f"has {final} layers)")
    train = features_for(lm, train_convs, [*exits, final], progress, cancel)
    heldout = features_for(lm, heldout_convs, [*exits, final], progress, cancel)
    times = {"features_s": round(time.perf_counter() - start, 1)}
    vocab_size = lm.model.get_output_embeddings().weight.shape[0]
    rows = fitting_vocab(lm.model, config.draft_vocab, config.max_memory_share)
    vocab = draft_vocabulary(train, rows, lm.eos_ids, vocab_size)
    head = draft_head(lm.model, vocab).float()
    adapters, fits = {}, {}
    mark = time.perf_counter()
    for i, exit_layer in enumerate(exits):
        elapsed = time.perf_counter() - start
        left = options.max_minutes * 60 - elapsed - config.calibration.seconds
        train_config = dataclasses.replace(options.train, lr=config.lr, epochs=config.epochs,
                                           max_seconds=max(10.0, left / (len(exits) - i)))
        progress(Progress("train", 0, 1, f"exit layer {exit_layer}: training the adapter"))
        adapter = Adapter.from_model(lm.model, source_layer(lm.model, exit_layer, config.init),
                                     torch.float32)
        start_from(adapter, options, progress, "adapter.", exit_layer=exit_layer)  # Retrain
        fits[exit_layer] = fit_adapter(lm, adapter, head, vocab, (train, heldout), exit_layer,
                                       config, train_config, progress, cancel)
        adapters[exit_layer] = adapter.requires_grad_(False)
        if cancel is not None and cancel.is_set():
            break
    times["train_s"] = round(time.perf_counter() - mark, 1)
    if cancel is not None and cancel.is_set():
        return {}, {}, {"times": times}  # the pipeline saves nothing after a cancel
    mark = time.perf_counter()
    prompts = [prompt_ids(lm, conv) for conv in heldout_convs]
    result = calibrate(lm, adapters, vocab, prompts, config.calibration, progress, cancel)
    times["calibrate_s"] = round(time.perf_counter() - mark, 1)
    chosen: KangarooSettings = result.settings
    # The drafter's own checkpoint layout, with the adapter in the model's dtype.
    tensors = KangarooDrafter(lm, adapters[chosen.exit_layer], chosen, vocab).tensors()
    settings = {**chosen.to_json(), "pays": result.pays_off,
                # where calibration timed it: another dtype or device re-times at load
                "quant": lm.quant, "device": lm.device.type, "machine": machine(lm),
                "draft_vocab_size": int(vocab.numel()) if vocab is not None else int(vocab_size)}
    metrics = {
        "pays": result.pays_off, "speedup": result.speedup, "chosen": chosen.to_json(),
        "agreement": {str(e): fit["agreement"] for e, fit in fits.items()},
        "train": {str(e): fit for e, fit in fits.items()}, "calibration": result.table,
        "ctar": result.ctar, "mean_accepted": result.mean_accepted,
        "vocab_coverage": coverage(heldout, vocab),
        "train_tokens": train.tokens, "heldout_tokens": heldout.tokens, "times": times,
    }
    return tensors, settings, metrics


def summary_lines(metrics: dict, settings: dict) -> list[str]:
    """What the trained Kangaroo drafter does here, for people (the train command prints it)."""
    agreement = ", ".join(f"l={e} {a * 100:.1f}%" for e, a in metrics.get("agreement", {}).items())
    lines = [f"held-out top-1 agreement with the model: {agreement}",
             f"draft vocabulary: {settings.get('draft_vocab_size')} tokens "
             f"({metrics.get('vocab_coverage', 0) * 100:.1f}% of held-out answer tokens)"]
    speedup = metrics.get("speedup", 0.0)
    if metrics.get("pays"):
        ctar = " ".join(f"{c:.2f}" for c in metrics.get("ctar", []))
        lines.append(f"chosen: exit layer {settings['exit_layer']}, eta {settings['eta']}, gamma "
                     f"{settings['gamma']}: estimated {speedup:.2f}x plain decoding, "
                     f"{metrics.get('mean_accepted', 0):.2f} tokens per round, CTAR(1..6) {ctar}")
    else:
        lines.append("Kangaroo does not pay on this machine (the best setting is estimated at "
                     f"{speedup:.2f}x plain decoding): --accel kangaroo will decode exactly like "
                     "plain decoding, never slower.")
    return lines

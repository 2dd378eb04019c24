"""The method table: every way of generating the benchmark compares, behind one call.

A Contender turns prompt ids into an Outcome (tokens, time to first token, accepted drafts per
step); the runner times the call and measures memory the same way for all of them. Peers are
Hugging Face `generate()` variants on the same model object; ours go through the engine's
one decode loop (engine.decode.generate.run) with or without a drafter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from bench.leaveout import WITH_STORE, LeaveOneOut
from engine.config import SamplingParams
from engine.decode.drafter import Drafter
from engine.decode.generate import run
from engine.drafters.registry import ACCEL_CHOICES, compose, load_source, over_store
from engine.errors import AcceleratorError, QuickdraftError

HF_METHODS = ("hf", "hf-lookup", "hf-assisted")
ACCELERATORS = tuple(c for c in ACCEL_CHOICES if c != "off")  # the engine's drafters
NO_STORE = "auto-no-datastore"  # Auto with the datastore left out (the bench's comparison)
METHOD_CHOICES = (*HF_METHODS, "vanilla", *ACCELERATORS, NO_STORE, "llama.cpp",
                  "llama.cpp-lookup")
BASELINE = "hf"  # every speedup is measured against this method
OVERALL = "all"  # the report column that pools every category
LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens for hf-lookup


@dataclass
class Outcome:
    """What one method produced for one prompt (the runner adds wall time and memory)."""

    ids: list[int]  # generated token ids, EOS included when reached
    ttft_s: float  # time to the first generated token
    accepted: list[int] | None  # per full-model step after prefill: drafts accepted; None = unknown
    used: dict[str, int] | None = None  # Auto: steps drafted by each of its arms


@dataclass
class Contender:
    """One entry of the method table."""

    name: str  # as shown in the report, e.g. "hf-lookup"
    generate: Callable[[list[int]], Outcome]  # prompt ids -> outcome, same settings every call
    held_out: LeaveOneOut | None = None  # its datastore, refilled per prompt, untimed (leaveout)


def method_names(text: str | None, with_assistant: bool) -> list[str]:
    """Parse --methods ("hf,vanilla"); None = the default set. `hf` always runs, first."""
    if text is None:
        names = ["hf", "hf-lookup", *(["hf-assisted"] if with_assistant else []),
                 "vanilla", *ACCELERATORS, NO_STORE]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHOD_CHOICES]
    if unknown:
        raise QuickdraftError(
            f"unknown method {unknown[0]!r}: choose from {', '.join(METHOD_CHOICES)}"
        )
    if "hf-assisted" in names and not with_assistant:
        raise QuickdraftError("hf-assisted needs a smaller model with the same tokenizer: "
                              "pass --assistant M")
    names = list(dict.fromkeys(names))  # drop repeats, keep order
    return [BASELINE] + [n for n in names if n != BASELINE]


def build_methods(lm, names: list[str], params: SamplingParams,
                  assistant=None) -> tuple[dict[str, Contender], dict[str, str]]:
    """The method table for `names`, and {name: reason} for methods that cannot run here
    (an accelerator not trained for this model, llama.cpp without its binding or GGUF file).
    Methods that draft from the datastore share one, filled leave-one-out per prompt."""
    methods: dict[str, Contender] = {}
    skipped: dict[str, str] = {}
    held_out = LeaveOneOut(lm) if set(names) & set(WITH_STORE) else None
    for name in names:
        if name == "hf":
            methods[name] = hf_method(name, lm, params)
        elif name == "hf-lookup":
            methods[name] = hf_method(name, lm, params, prompt_lookup_num_tokens=LOOKUP_TOKENS)
        elif name == "hf-assisted":
            _check_same_vocab(lm, assistant)
            methods[name] = hf_method(name, lm, params, assistant_model=assistant.model)
        elif name == "vanilla":
            methods[name] = engine_method(name, lm, params, Drafter())
        elif name in ("llama.cpp", "llama.cpp-lookup"):
            from bench.llamacpp import llamacpp_decoder

            decode, reason = llamacpp_decoder(lm, params, lookup=name.endswith("-lookup"))
            if decode is None:
                skipped[name] = reason
            else:  # tokens per step unknown: llama.cpp does not draft here
                methods[name] = Contender(name, lambda ids, d=decode: Outcome(*d(ids), None))
        else:
            drafter, reason = _accelerator(lm, name, held_out)
            if drafter is None:
                skipped[name] = reason
            else:
                methods[name] = engine_method(name, lm, params, drafter)
                if name in WITH_STORE:
                    methods[name].held_out = held_out
    return methods, skipped


def _accelerator(lm, name: str, held_out: LeaveOneOut | None) -> tuple[Drafter | None, str]:
    """The method's drafter; its datastore (and Auto's) is the leave-one-out one, and
    NO_STORE is Auto without one."""

    def source(m: str) -> Drafter:
        if m == "datastore":
            if held_out is None:
                raise AcceleratorError("left out")
            return over_store(held_out.store, lm)
        return load_source(lm, m)

    try:
        if name == NO_STORE:
            held_out = None
            return compose(lm, "auto", source), ""
        return compose(lm, name, source), ""
    except AcceleratorError as exc:
        return None, f"not trained: {exc}"
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("engine."):
            raise
        return None, f"not available in this build ({exc.name} is missing)"


def _check_same_vocab(lm, assistant) -> None:
    if assistant is None:
        raise QuickdraftError("hf-assisted needs --assistant M")
    if assistant.tokenizer.get_vocab() != lm.tokenizer.get_vocab():
        raise QuickdraftError(
            f"the assistant {assistant.model_id} uses another tokenizer than {lm.model_id}: "
            "hf-assisted needs the same vocabulary"
        )


def engine_method(name: str, lm, params: SamplingParams, drafter: Drafter) -> Contender:
    """The engine's decode loop with `drafter` (plain decoding for the base Drafter)."""

    def generate(prompt_ids: list[int]) -> Outcome:
        _text, ids, stats = run(lm, prompt_ids, params, drafter)
        # Auto's mix of step kinds in this reply (the other compositions keep one too)
        used = dict(stats.step_kinds) if name == "auto" else None
        return Outcome(ids, stats.ttft_s, list(stats.accepted), used)

    return Contender(name, generate)


def hf_method(name: str, lm, params: SamplingParams, **extra) -> Contender:
    """Hugging Face `generate()` on the same model with the same settings, plus `extra`
    (prompt_lookup_num_tokens=..., assistant_model=...). The settings are spelled out, so
    the model's own defaults such as a top_k of 50 cannot change what is compared."""
    pad = lm.tokenizer.pad_token_id
    sampling = ({"do_sample": False} if params.greedy else
                {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                 "top_k": params.top_k})
    kwargs = {"max_new_tokens": params.max_new_tokens, "eos_token_id": list(lm.eos_ids),
              "pad_token_id": pad if pad is not None else lm.eos_ids[0], **sampling, **extra}

    def generate(prompt_ids: list[int]) -> Outcome:
        clock = _FirstTokenClock()
        steps = StepRecorder(prompt_len=len(prompt_ids))
        input_ids = torch.tensor([prompt_ids], device=lm.device)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        handle = lm.model.register_forward_pre_hook(steps.hook, with_kwargs=True)
        try:
            with torch.inference_mode():
                clock.start = time.perf_counter()
                out = lm.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        streamer=clock, **kwargs)
        finally:
            handle.remove()
        ids = out[0, len(prompt_ids):].tolist()
        return Outcome(ids, clock.ttft_s, steps.accepted(len(ids)))

    return Contender(name, generate)


class _FirstTokenClock(BaseStreamer):
    """A generate() streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.start = 0.0
        self.ttft_s = 0.0
        self.puts = 0  # generate() puts the prompt first, then new tokens

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        """Nothing to flush."""


@dataclass
class StepRecorder:
    """Watches the target model's forward calls inside generate() to recover, per step,
    how many drafted tokens were kept (generate() itself does not report it)."""

    prompt_len: int  # tokens of the prompt
    cache_lens: list[int] = field(default_factory=list)  # cache length when each call began
    input_lens: list[int] = field(default_factory=list)  # tokens fed to each call
    known: bool = True  # False once a call came without a cache to read

    def hook(self, _module, _args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids")
        if cache is None or ids is None:
            self.known = False
            return
        self.cache_lens.append(cache.get_seq_length())
        self.input_lens.append(ids.shape[1])

    def accepted(self, new_tokens: int) -> list[int] | None:
        """Drafts accepted per forward pass. A call's kept tokens run from where its cache
        began (or the prompt's end) to where the next call's cache begins; the last call's
        end is the prompt plus the new tokens minus the last, never-cached one. A first call
        over exactly the prompt is the prefill, not a step (as in the engine's stats)."""
        if not self.known or not self.cache_lens:
            return None
        ends = self.cache_lens[1:] + [self.prompt_len + new_tokens - 1]
        accepted = []
        for i, (begin, end) in enumerate(zip(self.cache_lens, ends, strict=True)):
            if i == 0 and self.input_lens[0] == self.prompt_len:
                continue
            kept = end - max(begin, self.prompt_len - 1)
            accepted.append(kept - 1)
        return accepted

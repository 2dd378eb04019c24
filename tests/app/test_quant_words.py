"""The quantization in words people read: the chat's header names the weights in a few
words, the Models tab says what Auto measured to choose them (answers, perplexity, step
speed against bf16's, never milliseconds timed at first load), and each choice names the
kernels that run it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from app.quant_words import quant_record, quant_short
from app.ui.models import quant_labels
from engine.config import ModelSpec
from engine.weights.quant_auto import Choice

RECORDS = {"fp32": dict(right=31, same=36, perplexity=35.13, ms=359.9, admitted=True),
           "bf16": dict(right=32, same=40, perplexity=35.10, ms=170.0, admitted=True),
           "int8w": dict(right=31, same=30, perplexity=35.40, ms=85.0, admitted=True),
           "int4": dict(right=27, same=22, perplexity=37.0, ms=0.0, admitted=False)}


def _loaded(asked: str = "auto") -> SimpleNamespace:
    choice = Choice("int8w", "int8w: the smallest ...", 52, RECORDS)
    return SimpleNamespace(quant="int8w", device=torch.device("cpu"), spec=ModelSpec(quant=asked),
                           quant_choice=choice, quant_reason=choice.reason)


def test_the_header_names_the_weights_in_a_few_words():
    short = quant_short(_loaded())
    assert short == "8-bit weights (int8w) on cpu, chosen by Auto"
    assert quant_short(_loaded("int8w")).endswith("as asked")


def test_the_models_tab_says_what_auto_measured_in_words():
    record = quant_record(_loaded())
    assert "ms" not in record and "ppl" not in record  # no clock readings, no jargon
    assert "- **8-bit weights (int8w)**: 31 of 52 questions right" in record
    assert "step 2.00× as fast as bf16's. Chosen." in record
    assert "4-bit weights (int4)**: 27 of 52 questions right" in record
    assert "Not used: more than 1 question fewer right than bf16 (32)" in record
    assert "<details><summary>" in record  # the candidates behind a click


def test_each_low_bit_choice_names_the_kernels_that_run_it(monkeypatch):
    monkeypatch.setattr("engine.weights.kernels.problem", "")  # they built here
    cpu = dict((v, k) for k, v in quant_labels("cpu"))
    assert cpu["int4"] == "4-bit (Quickdraft's own CPU kernels)"
    assert cpu["int8w"] == "8-bit (Quickdraft's own CPU kernels)"
    assert dict((v, k) for k, v in quant_labels("cuda"))["int4"] == "4-bit (PyTorch's CUDA kernels)"
    assert not any("PyTorch kernels" in label for label, _q in quant_labels("cpu"))
    monkeypatch.setattr("engine.weights.kernels.problem", "no compiler")  # they could not be built
    assert dict((v, k) for k, v in quant_labels("cpu"))["int4"] == "4-bit (PyTorch's kernels)"

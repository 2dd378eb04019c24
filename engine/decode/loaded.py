"""A model ready to decode: the object every part of the engine is handed (`lm`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import devices
from engine.config import ModelSpec
from engine.decode.target import Target


@dataclass
class LoadedModel:
    """A model ready to decode, with everything accelerators and the UI need to know."""

    model: torch.nn.Module  # a transformers causal LM in eval mode
    tokenizer: object  # its tokenizer (with the chat template when the model has one)
    spec: ModelSpec  # what the user asked for
    model_id: str  # repo id, "default"'s repo id, or the local folder path
    quant: str  # the resolved quantization: int4 | int8w | nf4 | int8 | bf16 | fp32
    device: torch.device
    eos_ids: tuple[int, ...]  # tokens that end a reply
    context_len: int  # positions the model supports
    fingerprint: str  # ties accelerator checkpoints to this exact model
    load_seconds: float
    quant_reason: str = ""  # why --quant auto chose `quant` here ("" when it was asked for)
    device_line: str = ""  # which device runs it and why (engine.devices.device_line)
    quant_choice: object = None  # --quant auto's quant_auto.Choice: the record it chose by
    target: Target | None = None  # how decode steps run (set by wrap_model)
    # engine.decode.timing.step_cost's curves by target step name, timed on first use
    step_costs: dict = field(default_factory=dict, repr=False, compare=False)
    # engine.decode.grammar's tokenizer view for this model, built on first use
    grammars: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations and drafter weights use."""
        return devices.compute_dtype(self.quant, self.device)

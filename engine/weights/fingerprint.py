"""The fingerprint that ties accelerator checkpoints to one model's weights."""

from __future__ import annotations

import hashlib
import json

import torch

from engine.weights.gguf_blocks import BlockLinear

FINGERPRINT_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings",
)


def fingerprint(model) -> str:
    """Hash of the architecture, vocabulary size and a sample of the LM head.

    The sample is cast to bf16 so the same weights loaded in fp32, bf16 or 4-bit (the LM
    head stays unquantized) give the same fingerprint, and a GGUF file's the same whether
    it runs on its blocks or expanded (its blocks give the same values); a fine-tune changes it.
    """
    cfg = model.config.to_dict()
    arch = {k: cfg.get(k) for k in FINGERPRINT_FIELDS}
    head = model.get_output_embeddings()
    if isinstance(head, BlockLinear):  # a GGUF file's blocks: only the sampled rows are read
        rows = torch.linspace(0, head.out_features - 1, 64).long()
        sample = head.rows(rows)[:, :32].to(torch.bfloat16)
    else:
        weight = head.weight
        rows = torch.linspace(0, weight.shape[0] - 1, 64).long()
        sample = weight.detach()[rows.to(weight.device), :32].to("cpu", torch.bfloat16)
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]

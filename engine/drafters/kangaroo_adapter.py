"""The Kangaroo adapter (RMSNorm -> one attention block in the model's own layout
[-> FFN] -> RMSNorm) that turns the early exit's states into drafts, and the frozen LM-head
rows it drafts over. Training builds it from the model's last layer; the drafter loads it
from a checkpoint."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from engine.drafters import kangaroo_layers as layers


class Adapter(nn.Module):
    """RMSNorm -> attention (+ residual) [-> RMSNorm -> FFN (+ residual)] -> RMSNorm.

    Built from the model's own classes, so it has the model's head count, grouped-query
    layout, q/k norms and biases; its output goes through the model's frozen LM head.
    """

    def __init__(self, model, ffn: bool = False):
        super().__init__()
        layers.check_supported(model)
        config = model.config
        last = model.model.layers[-1]
        eps = config.rms_norm_eps
        self.norm_in = type(last.input_layernorm)(config.hidden_size, eps=eps)
        self.attn = type(last.self_attn)(config, layer_idx=0)  # layer 0 of the adapter's cache
        self.ffn_norm = self.mlp = None
        if ffn:
            self.ffn_norm = type(last.post_attention_layernorm)(config.hidden_size, eps=eps)
            self.mlp = type(last.mlp)(config)
        self.norm_out = type(model.model.norm)(config.hidden_size, eps=eps)

    @classmethod
    def from_model(cls, model, ffn: bool = False, dtype: torch.dtype = torch.float32) -> Adapter:
        """An adapter initialised from the model's last layer (attention, norms, FFN) and
        final norm, in `dtype` (quantized source weights are dequantized)."""
        adapter = cls(model, ffn)
        last = model.model.layers[-1]
        pairs = [(adapter.norm_in, last.input_layernorm), (adapter.attn, last.self_attn),
                 (adapter.norm_out, model.model.norm)]
        if ffn:
            pairs += [(adapter.ffn_norm, last.post_attention_layernorm), (adapter.mlp, last.mlp)]
        with torch.no_grad():
            for dst, src in pairs:
                _copy_dense(src, dst)
        return adapter.to(device=model.model.embed_tokens.weight.device, dtype=dtype)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, cache: DynamicCache | None = None) -> torch.Tensor:
        """h: (B, S, H) layer-l states -> (B, S, H) states for the LM head."""
        x = h + self.attn(self.norm_in(h), rope, mask, cache)[0]
        if self.mlp is not None:
            x = x + self.mlp(self.ffn_norm(x))
        return self.norm_out(x)


def sequence_states(model, adapter: Adapter, x: torch.Tensor,
                    pad: torch.Tensor | None = None) -> torch.Tensor:
    """Adapter over whole sequences x (B, S, H) from position 0, causally, without a cache
    (training and teacher-forced evaluation); pad: (B, S) 1 on real tokens, or None."""
    pos = layers.positions(0, x.shape[1], x.device).expand(x.shape[0], -1)
    rope = model.model.rotary_emb(x, pos)
    mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=pad,
                              cache=None, position_ids=pos)
    return adapter(x, rope, mask)


def _dense_weight(module: nn.Module) -> torch.Tensor:
    """A linear's weight as a plain tensor (bitsandbytes 4-/8-bit weights are dequantized)."""
    if type(module.weight).__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(module)
    return module.weight


def _copy_dense(src: nn.Module, dst: nn.Module) -> None:
    """Copy src's parameters into dst (same structure), dequantizing on the way."""
    for name, module in dst.named_modules():
        source = src.get_submodule(name) if name else src
        for pname, param in module.named_parameters(recurse=False):
            value = _dense_weight(source) if pname == "weight" else getattr(source, pname)
            param.copy_(value.detach().to(param.device, param.dtype).reshape(param.shape))


def draft_head(model, vocab: torch.Tensor | None) -> torch.Tensor:
    """(Vd, H) rows of the frozen LM head the drafter scores: all, or the reduced vocabulary
    (a copy of those rows: one contiguous matmul per draft token)."""
    weight = _dense_weight(model.get_output_embeddings()).detach()
    return weight if vocab is None else weight[vocab.to(weight.device)].clone()

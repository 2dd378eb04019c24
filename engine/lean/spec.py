"""What the lean step needs to know about a model's family: one description per loaded model,
read from its config and modules, or None where the family differs from the Llama layout in
more than a norm, a scale or a flag (those models keep the transformers path).

The families covered are Llama's layer with small differences: Llama 2/3, Mistral, Qwen2/2.5
(q/k/v biases), Qwen3 (per-head q/k norms), SmolLM/SmolLM2 (Llama), Phi-3 (fused
projections), Gemma 2 (norms around both sub-blocks, (1 + w) norms, soft-capping, alternating
sliding windows) and OLMo-2 (norms after both sub-blocks, q/k norms over all heads).
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "olmo2")
# rotary variants whose table for a position does not depend on the sequence length, so one
# table computed once serves every step (dynamic and long-rope scaling switch with length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LeanSpec:
    """The shape and the family's variations of one decoder-only model."""

    layers: int  # decoder layers
    hidden: int  # H: the residual stream's width
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when fewer than heads)
    head_dim: int  # D
    eps: float  # RMSNorm epsilon
    norm: str  # "llama": w * x.to(dtype); "gemma": (x * (1 + w)).to(dtype); "olmo": (w * x)
    sandwich: bool  # Gemma 2: norms before AND after attention and MLP
    post_only: bool  # OLMo-2: no input norms; norms after attention and MLP outputs
    qk_norm: str  # "": none; "head": per head over D (Qwen3); "all": over all heads (OLMo-2)
    scaling: float  # attention scores are q.k * scaling
    attn_softcap: float | None  # Gemma 2: scores -> tanh(scores / cap) * cap
    final_softcap: float | None  # Gemma 2: logits -> tanh(logits / cap) * cap
    windows: tuple[int | None, ...]  # per layer: sliding window, None = full attention
    fused: bool  # Phi-3: qkv_proj and gate_up_proj already fused in the checkpoint
    act: str  # the MLP's activation, by transformers' name (silu, gelu_pytorch_tanh, ...)
    context: int  # positions the model supports

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads


def spec_for(model) -> LeanSpec | None:
    """The lean description of `model`, or None when the lean step does not cover it."""
    config = model.config
    kind = getattr(config, "model_type", "")
    base = getattr(model, "model", None)
    if kind not in FAMILIES or base is None or not hasattr(base, "layers"):
        return None
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gemma = kind == "gemma2"
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    return LeanSpec(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        norm="gemma" if gemma else "olmo" if kind == "olmo2" else "llama",
        sandwich=gemma,
        post_only=kind == "olmo2",
        qk_norm={"qwen3": "head", "olmo2": "all"}.get(kind, ""),
        scaling=(scalar or head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        windows=tuple(_window(config, i) for i in range(config.num_hidden_layers)),
        fused=kind == "phi3",
        act=getattr(config, "hidden_activation", None) or config.hidden_act,
        context=int(getattr(config, "max_position_embeddings", 2048) or 2048),
    )


def _window(config, layer: int) -> int | None:
    """Layer `layer`'s sliding window, as transformers applies it (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return window if types[layer] == "sliding_attention" else None
    return window

"""A GGUF writer for Llama and Qwen2 models (llama.cpp's tensor names, Llama's q/k row order,
Qwen2's q/k/v biases, float or quantized blocks), with the bundled model's tokenizer: how the
tests build GGUF files and how scripts/scaled_gguf.py writes a larger held-out model for the
memory and speed reports."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from engine.model.loading import bundled_gguf

# HF llama parameter names -> GGUF tensor names (llama.cpp's convert script does the same).
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # Qwen2's
UNUSED_TOKEN = 5  # llama.cpp's token type of a vocabulary's padding entries
TOKENIZER_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges", "tokenizer.chat_template")


@functools.lru_cache(maxsize=1)
def tokenizer_fields() -> dict:
    """The bundled model's tokenizer fields (tokens, types, merges, chat template)."""
    from gguf import GGUFReader

    reader = GGUFReader(bundled_gguf())
    return {key: reader.get_field(key).contents() for key in TOKENIZER_FIELDS}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path: Path, model, vocab: dict, arch: str = "llama", odd_type=False,
               qtype: str | None = None) -> Path:
    """`model`'s fp32 weights and the bundled tokenizer as a GGUF file; `odd_type` stores one
    tensor as Q8_1, a type llama.cpp uses only internally (gguf cannot dequantize it);
    `qtype` (e.g. "Q4_0") stores every layer matrix in that type and the token table and head
    in Q8_0, as llama.cpp's own 4-bit files keep them. A model with more rows in its table
    than the vocabulary has tokens gets unused padding tokens (as Qwen2.5's files do)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = model.config
    vocab = padded_vocab(vocab, cfg.vocab_size)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope))
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokenizer.ggml.tokens"])
    w.add_token_types(vocab["tokenizer.ggml.token_type"])
    w.add_token_merges(vocab["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    if arch == "qwen2":  # the file's own fields would otherwise be llama.cpp's defaults
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab["tokenizer.chat_template"])
    for name, tensor in gguf_tensors(model, permuted=arch != "qwen2").items():
        if odd_type and name == "blk.0.ffn_up.weight":
            rows, cols = tensor.shape  # Q8_1: blocks of 32 values in 40 bytes
            w.add_tensor(name, np.zeros((rows, cols // 32 * 40), np.uint8),
                         raw_dtype=GGMLQuantizationType.Q8_1)
            continue
        kind = stored_type(name, tensor, qtype)
        if kind is None:
            w.add_tensor(name, tensor)
        else:
            kind = GGMLQuantizationType[kind]
            w.add_tensor(name, quants.quantize(tensor, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def stored_type(name: str, tensor: np.ndarray, qtype: str | None) -> str | None:
    """The GGUF type `name` is written in under `qtype` (None: float32)."""
    if qtype is None or tensor.ndim != 2:
        return None
    table = name in ("token_embd.weight", "output.weight")
    return "Q8_0" if table and qtype != "F16" else qtype


def padded_vocab(vocab: dict, size: int) -> dict:
    """`vocab` with unused tokens appended up to `size` entries."""
    tokens = list(vocab["tokenizer.ggml.tokens"])
    if len(tokens) >= size:
        return vocab
    extra = size - len(tokens)
    return {**vocab, "tokenizer.ggml.tokens": tokens + [f"<|unused_{i}|>" for i in range(extra)],
            "tokenizer.ggml.token_type": [*vocab["tokenizer.ggml.token_type"]]
            + [UNUSED_TOKEN] * extra}


def gguf_tensors(model, permuted: bool = True) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names (`permuted`: Llama's q/k row order; a
    tied head is stored once, as the table)."""
    cfg = model.config
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf, gg in LAYER_NAMES.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q" and permuted:
                weight = permute(weight, cfg.num_attention_heads)
            elif gg == "attn_k" and permuted:
                weight = permute(weight, cfg.num_key_value_heads)
            out[f"blk.{i}.{gg}.weight"] = weight
            bias = state.get(f"model.layers.{i}.{hf}.bias")
            if hf in BIASES and bias is not None:
                out[f"blk.{i}.{gg}.bias"] = bias
    return out

"""Write a model N times the bundled one's size, or of a known model's shapes, as a GGUF
file, to time Quickdraft against llama.cpp on a bigger model than the bundled one.

    python -m scripts.scaled_gguf --scale 4 --out /tmp/scaled-x4-q4_0.gguf [--qtype Q4_0]
    python -m scripts.scaled_gguf --like qwen2.5-0.5b --qtype F16 --out /tmp/qwen-like-f16.gguf
    llama-quantize /tmp/qwen-like-f16.gguf /tmp/qwen-like-q4_k_m.gguf Q4_K_M
    python launcher.py bench --model /tmp/qwen-like-q4_k_m.gguf --methods vanilla,llama.cpp

`--scale`: the bundled model's family, tokenizer and chat template, wider and deeper. `--like`:
a model family's shapes (Qwen2.5's: its 151,936-row table, biases, tied head), with the
bundled tokenizer padded to that vocabulary. Either way the weights are random: the text is
noise, but every step costs what it would on a real model of that size. Layer matrices are
stored in --qtype (F16 for llama-quantize to make K-quant files from), the token table and
head in Q8_0 (F16 with --qtype F16), as llama.cpp's own files keep them. Run it alone (a few
minutes).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from engine.config import ModelSpec
from engine.model.loading import load_model


def scaled_model(scale: float, folder: Path) -> int:
    """Save a model `scale` times the bundled one's parameters into `folder` (bf16
    safetensors and the bundled tokenizer); returns its parameter count. Width and depth
    grow together (width by sqrt(scale) in whole heads, depth makes up the rest), as model
    families grow."""
    import torch
    from transformers import AutoModelForCausalLM

    base = load_model(ModelSpec(quant="bf16"))
    config = base.model.config.to_dict()
    base_params = sum(p.numel() for p in base.model.parameters())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    heads = round(config["num_attention_heads"] * scale**0.5)
    kv = max(1, round(heads * config["num_key_value_heads"] / config["num_attention_heads"]))
    heads = kv * max(1, heads // kv)  # grouped attention: heads a multiple of kv heads
    width = heads * head_dim
    config.update(hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=round(config["intermediate_size"] * width
                                          / config["hidden_size"] / 64) * 64)
    per_layer = 2 * width * width + 2 * width * kv * head_dim + 3 * width * config[
        "intermediate_size"]
    embed = config["vocab_size"] * width
    config["num_hidden_layers"] = max(1, round((scale * base_params - embed) / per_layer))
    config.pop("quantization_config", None)
    cfg = type(base.model.config).from_dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    base.tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


# Known models' shapes (transformers config fields), for --like.
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, rope_theta=1000000.0),
}


def shaped_model(name: str):
    """A random fp32 model of `name`'s shapes (SHAPES), with the bundled model's special
    token ids."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), bos_token_id=1, eos_token_id=2,
                                  **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--like", choices=sorted(SHAPES),
                        help="a known model's shapes instead of a scaled bundled model")
    parser.add_argument("--qtype", default="Q4_0",
                        help="a GGUF type gguf can write: Q4_0, Q5_0, Q8_0, F16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    # The suite's GGUF writer (llama.cpp's tensor names and row order, quantized blocks).
    from bench.gguf_writer import tokenizer_fields, write_gguf

    if args.like:
        model = shaped_model(args.like)
        params = sum(p.numel() for p in model.parameters())
    else:
        with tempfile.TemporaryDirectory(prefix="quickdraft-scaled-") as folder:
            params = scaled_model(args.scale, Path(folder))
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    write_gguf(args.out, model, tokenizer_fields(), arch=model.config.model_type,
               qtype=args.qtype)
    print(f"{args.out}: {params / 1e6:.0f}M parameters, {args.qtype}, "
          f"{args.out.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

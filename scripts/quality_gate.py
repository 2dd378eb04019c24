"""Perplexity of every weight choice on the held-out text, beside llama.cpp's own GGUF file.

    python -m scripts.quality_gate [--model default] [--tokens 512] [--out F]

The same token ids (the engine's tokenizer, assets/heldout_text.txt) are scored by fp32,
bf16, each low-bit choice and, when the llama_cpp binding is installed, by llama.cpp on the
GGUF file the model came from (all positions' logits of one evaluation). Greedy agreement is
the share of positions whose argmax equals bf16's. The binding is optional: without it the
llama.cpp row says why it is missing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

from bench.llamacpp import gguf_file
from engine.config import ModelSpec
from engine.model.loading import load_model
from engine.weights.quant import LOW_BIT, quantize_model
from engine.weights.quant_auto import heldout_ids


def score(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity of ids under model, argmax per position): the same pair llama.cpp's row
    gives, so every row is compared alike."""
    with torch.inference_mode():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, :-1]
    logits = logits.float().cpu()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item()), logits.argmax(-1)


def llamacpp_score(path: Path, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax per position) of ids under llama.cpp on the GGUF file."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(512, ids.shape[1] + 8),
                          n_batch=ids.shape[1], logits_all=True,
                          n_threads=torch.get_num_threads(), verbose=False)
    llm.eval(ids[0].tolist())
    logits = torch.from_numpy(np.array(llm.scores[: ids.shape[1] - 1], dtype=np.float32))
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item()), logits.argmax(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lm = load_model(ModelSpec(source=args.model, quant="fp32", device="cpu"))
    ids = heldout_ids(lm.tokenizer, args.tokens)
    rows = {"fp32": score(lm.model, ids)}
    bf16 = copy.deepcopy(lm.model).to(torch.bfloat16)
    rows["bf16"] = score(bf16, ids)
    for kind in LOW_BIT:
        rows[kind] = score(quantize_model(copy.deepcopy(bf16), kind, wide_rows=0), ids)
    path, missing = gguf_file(lm), ""
    try:
        if path is None:
            missing = "the model was not loaded from a GGUF file"
        else:
            rows[f"llama.cpp ({path.name})"] = llamacpp_score(path, ids)
    except ImportError as exc:
        missing = f"the llama_cpp binding is not installed ({exc})"
    ref = rows["bf16"][1]
    table = {name: {"perplexity": round(ppl, 3),
                    "agreement_with_bf16": round(float((top == ref).float().mean()), 4)}
             for name, (ppl, top) in rows.items()}
    print(f"held-out text, {ids.shape[1]} tokens, model {lm.model_id}")
    print("| weights | perplexity | greedy agreement with bf16 |\n|---|---:|---:|")
    for name, row in table.items():
        print(f"| {name} | {row['perplexity']:.2f} | {row['agreement_with_bf16']:.1%} |")
    if missing:
        print(f"llama.cpp not measured: {missing}")
    if args.out:
        args.out.write_text(json.dumps({"tokens": ids.shape[1], "model": lm.model_id,
                                        "rows": table, "llama.cpp missing": missing}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a model N times the bundled one's size as a 4-bit GGUF file, to time Quickdraft
against llama.cpp on a bigger model than the bundled one.

    python scripts/scaled_gguf.py --scale 4 --out /tmp/scaled-x4-q4_0.gguf [--qtype Q4_0]
    python launcher.py bench --model /tmp/scaled-x4-q4_0.gguf --methods vanilla,llama.cpp

The model is the bundled one's family, tokenizer and chat template, wider and deeper, with
random weights (`budget_check.scaled_model`): its text is noise, but every step costs what
it would on a real model of that size. Layer matrices are stored in --qtype, the token table
and head in Q8_0, as llama.cpp's 4-bit files keep them. Run it alone (a few minutes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from budget_check import scaled_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--qtype", default="Q4_0", help="a GGUF type gguf can write: Q4_0, Q8_0")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_gguf import tokenizer_fields, write_gguf

    with tempfile.TemporaryDirectory(prefix="quickdraft-scaled-") as folder:
        params = scaled_model(args.scale, Path(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    write_gguf(args.out, model, tokenizer_fields(), qtype=args.qtype)
    print(f"{args.out}: {params / 1e6:.0f}M parameters, {args.qtype}, "
          f"{args.out.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

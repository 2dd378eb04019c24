"""A one-shot `chat` answers on the eager step and, before it ends, leaves the compiled step
building in a process of its own that outlives it (engine/lean/builder.py); the next
`chat` runs compiled, and both name the step in their --json stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.lean import builder
from tests.paths import ROOT

# The first chat runs in a process of its own that ends before the build does; two compiled
# sizes instead of five keep the build short (the builder builds what the request lists).
FIRST = """
import sys
from engine.lean import compiled
compiled.SIZES = (1, 4)
from app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_chat_runs_compiled(bundled_tokenizer, tmp_path, monkeypatch, capsys):
    config = AutoConfig.for_model("llama", vocab_size=len(bundled_tokenizer), hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  initializer_range=0.2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    bundled_tokenizer.save_pretrained(tmp_path / "model")
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(cache))
    monkeypatch.delenv("QUICKDRAFT_NO_STEP_BUILDS")  # as a user runs it
    args = ["chat", "--model", str(tmp_path / "model"), "--quant", "fp32", "--prompt",
            "Tell me about rain", "--max-new-tokens", "16", "--json"]
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1"}
    out = subprocess.run([sys.executable, "-c", FIRST, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first = json.loads(out.stdout)
    assert first["stats"]["step"] == "lean-eager"
    assert "building the compiled decode step" in out.stderr
    # the command has ended before its builder: that works on in a process of its own
    folder = next((cache / "compiled").iterdir())
    assert builder.read(folder).state == "building"
    status = builder.wait(folder)
    assert status.state == "done", (folder / builder.LOG).read_text()[-2000:]
    assert status.pid not in (0, os.getpid())
    assert list((tmp_path / "cache" / "compiled").rglob("layer-*.pt2"))

    from app.cli import main
    from engine.lean import compiled

    monkeypatch.setattr(compiled, "SIZES", (1, 4))
    monkeypatch.setattr(builder, "start", _built_again)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["stats"]["step"] == "lean-compiled"
    assert second["token_ids"] == first["token_ids"]  # fp32: the same greedy reply


def _built_again(*_args):
    raise AssertionError("a builder was started again")

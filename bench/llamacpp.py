"""The llama.cpp peer: the same GGUF file the model was loaded from, decoded by llama.cpp
through its Python binding (llama-cpp-python, optional and imported only when asked for).

It is fed the engine's chat-template-encoded prompt ids as they are (never re-templated),
decodes greedily one token per call with the same budget, and stops at the model's EOS.
Its weights stay in the file's own quantization (Q4_1 for the bundled model), so its text
is not expected to match hf's token for token.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.config import SamplingParams
from engine.errors import QuickdraftError
from engine.weights import gguf


def gguf_file(lm) -> Path | None:
    """The GGUF file `lm` was loaded from, or None when it came from a folder or hub repo."""
    from engine.model.loading import bundled_gguf

    source = lm.spec.source.strip()
    if source == "default":
        path = bundled_gguf()
        return path if path is not None and path.is_file() else None
    path = Path(source).expanduser()
    if path.is_file():
        return path
    hub = None if path.exists() else gguf.parse_hub(source)
    if hub is not None:  # already in the cache: the model was loaded from it
        return gguf.hub_file(*hub, lm.spec.revision)
    return None


LOOKUP_TOKENS = 10  # llama-cpp-python's prompt-lookup default: tokens drafted per step
# Load the file and decode two tokens, as the bench will (argv[1]: the GGUF file).
PROBE = ("import sys, llama_cpp; llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, "
         "verbose=False).eval([1, 2])")
PROBE_S = 120  # seconds the probe may take (loading a large file included)


def probe(path: Path) -> str:
    """Why llama.cpp cannot decode `path` here, found in a child process ("" when it can).
    A binding built for instructions this CPU lacks dies of SIGILL at its first decode,
    which in this process would end the whole bench run with nothing written."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True,
                              text=True, timeout=PROBE_S)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not decode {path.name} within {PROBE_S} s"
    if done.returncode < 0:
        return (f"the llama_cpp binding crashes on this CPU "
                f"({signal.Signals(-done.returncode).name}: built for instructions it lacks); "
                "rebuild it for this CPU, see docs/benchmarks.md")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"llama.cpp could not decode {path.name}: {last}"
    return ""


def llamacpp_decoder(lm, params: SamplingParams, lookup: bool = False):
    """(decode, "") for llama.cpp on `lm`'s GGUF file, or (None, why it cannot run here);
    decode(prompt ids) -> (generated ids, seconds to the first token). `lookup`: with the
    binding's own draft-free speculation (prompt lookup, verified by llama.cpp)."""
    if not params.greedy:
        return None, "greedy only (run with --temperature 0)"
    path = gguf_file(lm)
    if path is None:
        return None, f"the model was not loaded from a GGUF file ({lm.model_id})"
    try:
        import llama_cpp
    except ImportError as exc:
        return None, f"the llama_cpp binding is not installed ({exc}); see docs/benchmarks.md"
    if why := probe(path):
        return None, why
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=lm.context_len, draft_model=draft,
                              n_threads=torch.get_num_threads(), verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise QuickdraftError(f"llama.cpp could not load {path}: {exc}") from exc
    eos = set(lm.eos_ids)

    def stream(prompt_ids: list[int]):
        """Greedy tokens after the prompt: the binding's own generate loop where its draft
        model runs, else one eval and argmax a token."""
        if lookup:
            yield from llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                    repeat_penalty=1.0)
            return
        batch = prompt_ids
        while True:
            token = _argmax_after(llama_cpp, llm, batch)
            yield token
            batch = [token]

    def decode(prompt_ids: list[int]) -> tuple[list[int], float]:
        llm.reset()  # no prefix reuse: every call prefills its whole prompt
        start = time.perf_counter()
        ids: list[int] = []
        ttft = 0.0
        for token in stream(prompt_ids):
            if not ids:
                ttft = time.perf_counter() - start
            ids.append(int(token))
            if token in eos or len(ids) >= params.max_new_tokens:
                break
        return ids, ttft

    return decode, ""


def _argmax_after(llama_cpp, llm, tokens: list[int]) -> int:
    """Feed `tokens`, return the greedy next token from the last position's logits."""
    import numpy as np

    llm.eval(tokens)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                   shape=(llm.n_vocab(),))
    return int(logits.argmax())

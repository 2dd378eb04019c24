"""The llama.cpp peer in the bench: accepted as a method, skipped with one line when it
cannot run, and the report's "vs llama.cpp" column. None of this needs the binding."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from bench import llamacpp
from bench.methods import METHOD_CHOICES, build_methods, method_names
from bench.report import build_report, notes, overall_table, summarize
from bench.runner import Measurement
from engine.config import ModelSpec, SamplingParams
from tests.conftest import make_tiny_model


def test_method_list_accepts_llamacpp():
    assert "llama.cpp" in METHOD_CHOICES
    assert method_names("vanilla,llama.cpp,llama.cpp-lookup", with_assistant=False) == [
        "hf", "vanilla", "llama.cpp", "llama.cpp-lookup"]


def _report(results, skipped):
    return build_report({}, {"temperature": 0}, results, skipped)


def _m(method, prompt, ids, wall):
    return Measurement(method, prompt, "qa", 10, ids, wall, wall / 10, None, 100.0, 1.0)


@pytest.mark.parametrize("source, why", [
    ("default", "llama_cpp binding is not installed"),  # the bundled GGUF, no binding
    (None, "not loaded from a GGUF file"),  # a model folder
])
def test_skipped_with_one_line(bundled_tokenizer, monkeypatch, source, why):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp fails
    lm = make_tiny_model("llama-mha", bundled_tokenizer, num_layers=1)
    if source is not None:
        lm.spec = ModelSpec(source=source)
    methods, skipped = build_methods(lm, ["hf", "llama.cpp", "llama.cpp-lookup"],
                                     SamplingParams(max_new_tokens=4))
    assert list(methods) == ["hf"]
    for peer in ("llama.cpp", "llama.cpp-lookup"):
        assert why in skipped[peer] and "\n" not in skipped[peer]
    lines = notes(_report([_m("hf", 0, [1, 2], 1.0)], skipped))
    assert [line for line in lines if "llama.cpp" in line] == [
        f"- llama.cpp did not run: {skipped['llama.cpp']}",
        f"- llama.cpp-lookup did not run: {skipped['llama.cpp-lookup']}"]


def test_vs_llamacpp_column():
    results = [_m("hf", 0, [1, 2, 3, 4], 1.0), _m("vanilla", 0, [1, 2, 3, 4], 0.5),
               _m("llama.cpp", 0, [1, 2, 3, 5], 0.25)]  # 4, 8 and 16 tok/s
    rows = overall_table(_report(results, {}))
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    col = header.index("vs llama.cpp")
    cells = {r.strip("|").split("|")[0].strip(): r.strip("|").split("|")[col].strip()
             for r in rows[2:]}
    assert cells == {"hf": "0.25x", "vanilla": "0.50x", "llama.cpp": "1.00x"}
    without = overall_table(_report(results[:2], {}))
    assert "vs llama.cpp" not in without[0]
    assert all(len(r.split("|")) == len(without[0].split("|")) for r in without)
    assert summarize(results, greedy=True)["llama.cpp"]["greedy_match_rate"] == 0.0


def test_llamacpp_text_differences_are_named_as_other_weights_not_mismatches():
    from bench.report import notes

    peer = {"mismatched_prompts": ["p1", "p2"], "prompts": 3, "greedy_match_rate": 1 / 3}
    report = {"settings": {"temperature": 0.0, "dtype": "bf16"}, "skipped": {},
              "measurements": [], "methods": {"llama.cpp": peer}}
    lines = notes(report)
    assert lines == ["- llama.cpp decodes the GGUF file's own weights, so its text differs "
                     "from hf on 2 of 3 prompts (exact match 33.3%)."]
    assert not any("MISMATCH" in line or "near-tie" in line for line in lines)


@pytest.mark.parametrize("code, why", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGILL)", "crashes on this CPU (SIGILL"),
    ("raise SystemExit('cannot open the file')", "could not decode x.gguf: cannot open the file"),
    ("pass", ""),
])
def test_the_probe_finds_a_failing_binding_in_a_child_process(monkeypatch, code, why):
    monkeypatch.setattr(llamacpp, "PROBE", code)
    got = llamacpp.probe(Path("x.gguf"))
    assert why in got and "\n" not in got if why else got == ""


def test_a_binding_that_crashes_here_is_skipped_and_the_bench_goes_on(bundled_tokenizer,
                                                                     monkeypatch):
    """A binding built for instructions this CPU lacks (SIGILL at its first decode) must
    not end the run: the peer is skipped with one line."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(llamacpp, "PROBE", "import os, signal; os.kill(os.getpid(), "
                                           "signal.SIGILL)")
    lm = make_tiny_model("llama-mha", bundled_tokenizer, num_layers=1)
    lm.spec = ModelSpec(source="default")
    methods, skipped = build_methods(lm, ["hf", "llama.cpp"], SamplingParams(max_new_tokens=4))
    assert list(methods) == ["hf"]
    assert "crashes on this CPU (SIGILL" in skipped["llama.cpp"]

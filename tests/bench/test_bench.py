"""The speed report: prompt files, the method table, figures computed from measurements, and
the three outputs, on tiny models with two prompts; the scripts that feed it (the GPU entry,
the scaled GGUF writer) kept working on the CPU."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from app import cli
from bench import runner as runner_mod
from bench.bench_run import bench_report
from bench.methods import (
    METHOD_CHOICES,
    Contender,
    Outcome,
    StepRecorder,
    build_methods,
    engine_method,
    method_names,
)
from bench.prompts import BenchPrompt
from bench.report import notes, summarize, to_markdown, write_report
from bench.runner import Measurement
from engine.config import SamplingParams
from engine.decode.drafter import Drafter, Session
from engine.errors import QuickdraftError
from scripts import bench_gpu, scaled_gguf
from tests.conftest import make_tiny_model

REPORT_KEYS = {"tokens_per_s", "speedup_vs_hf", "mean_accepted", "ctar", "greedy_match_rate",
               "peak_mem_mb", "by_category"}
def near(x):
    """Report figures are rounded to 4 decimals."""
    return pytest.approx(x, abs=1e-4)


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TWO_PROMPTS = [BenchPrompt("Name three colours.", "qa"),
               BenchPrompt("Translate 'good morning' to French.", "translation")]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine, two threads of tiny matmuls spend most of
    their time waiting for each other, which makes the tiny runs slow and erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the method table ------------------------------------------------------------------

def test_method_names():
    assert method_names(None, with_assistant=False)[:3] == ["hf", "hf-lookup", "vanilla"]
    assert "hf-assisted" in method_names(None, with_assistant=True)
    assert method_names("vanilla, hf-lookup,vanilla", False) == ["hf", "vanilla", "hf-lookup"]
    with pytest.raises(QuickdraftError, match="unknown method 'fast'"):
        method_names("hf,fast", False)
    with pytest.raises(QuickdraftError, match="--assistant"):
        method_names("hf-assisted", False)
    assert set(METHOD_CHOICES) >= {"hf", "hf-lookup", "hf-assisted", "vanilla", "medusa",
                                   "kangaroo"}


def test_step_recorder_recovers_accepted_drafts():
    # Plain decoding: prefill over the 5 prompt tokens, then one token per call.
    plain = StepRecorder(prompt_len=5, cache_lens=[0, 5, 6, 7], input_lens=[5, 1, 1, 1])
    assert plain.accepted(new_tokens=4) == [0, 0, 0]
    # Lookup: the first call verifies 3 candidates with the prompt and keeps 2 of them (3 new
    # tokens), the second keeps 4 drafts, the last keeps none.
    lookup = StepRecorder(prompt_len=5, cache_lens=[0, 7, 12], input_lens=[8, 5, 3])
    assert lookup.accepted(new_tokens=9) == [2, 4, 0]
    assert StepRecorder(5, known=False).accepted(3) is None


def test_untrained_accelerator_is_reported_not_fatal(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer, num_layers=1)
    methods, skipped = build_methods(lm, ["hf", "vanilla", "medusa", "kangaroo"],
                                     SamplingParams(max_new_tokens=4))
    assert list(methods) == ["hf", "vanilla"]
    assert set(skipped) == {"medusa", "kangaroo"}
    assert all(why.startswith(("not trained", "not available")) for why in skipped.values())


# ---- figures from measurements ----------------------------------------------------------

def _m(method, prompt, category, ids, wall, accepted, mem=100.0):
    return Measurement(method, prompt, category, 10, ids, wall, wall / 10, accepted, mem, 1.0)


def test_figures_are_computed_from_measurements():
    results = [
        _m("hf", 0, "qa", [1, 2, 3, 4], 1.0, [0, 0, 0]),
        _m("fast", 0, "qa", [1, 2, 3, 4], 0.5, [1, 1]),  # 2x on prompt 0
        _m("hf", 1, "math", [5, 6, 7, 8], 2.0, [0, 0, 0]),
        _m("fast", 1, "math", [5, 6, 9], 0.5, [3], mem=300.0),  # 3/0.5 vs 4/2: 3x, differs
    ]
    summary = summarize(results, greedy=True)
    fast = summary["fast"]
    assert fast["tokens_per_s"] == near(statistics.median([8.0, 6.0]))
    assert fast["speedup_vs_hf"] == near(statistics.median([2.0, 3.0]))
    assert fast["by_category"]["math"]["speedup_vs_hf"] == near(3.0)
    assert fast["mean_accepted"] == near((2 + 2 + 4) / 3)  # pooled steps
    assert fast["ctar"][:4] == near([1.0, 1 / 3, 1 / 3, 0.0])
    assert fast["greedy_match_rate"] == near(0.5)
    assert fast["prefix_match"] == near((1.0 + 2 / 4) / 2)
    assert fast["mismatched_prompts"] == [1]
    assert fast["peak_mem_mb"] == 300.0
    assert summary["hf"]["speedup_vs_hf"] == 1.0
    assert summary["hf"]["mean_accepted"] == 1.0


def test_the_same_text_view_compares_methods_on_identical_work_only():
    results = [
        _m("hf", 0, "qa", [1, 2, 3, 4], 1.0, [0, 0, 0]),
        _m("fast", 0, "qa", [1, 2, 3, 4], 0.5, [1, 1]),  # same text, 2x
        _m("hf", 1, "qa", [5, 6, 7, 8], 2.0, [0, 0, 0]),
        _m("fast", 1, "qa", [5, 6, 9], 0.25, [3]),  # another text, 6x: left out
        _m("hf", 2, "math", [1], 1.0, []),
        _m("fast", 2, "math", [2], 0.5, []),  # another text: no prompt left
    ]
    fast = summarize(results, greedy=True)["fast"]
    assert fast["speedup_vs_hf"] == near(statistics.median([2.0, 6.0, 2.0]))
    assert fast["same_text"] == {"prompts": 1, "tokens_per_s": near(8.0),
                                 "speedup_vs_hf": near(2.0), "speedup_vs_hf_passes": None}
    assert fast["by_category"]["math"]["same_text"] == {
        "prompts": 0, "tokens_per_s": None, "speedup_vs_hf": None}
    assert summarize(results, greedy=False)["fast"]["same_text"] is None


def test_sampling_reports_no_greedy_match():
    results = [_m("hf", 0, "qa", [1], 1.0, []), _m("x", 0, "qa", [2], 1.0, None)]
    x = summarize(results, greedy=False)["x"]
    assert x["greedy_match_rate"] is None and x["mean_accepted"] is None and x["ctar"] is None


# ---- end to end on a tiny model ------------------------------------------------------------

class BenchClock:
    """Injects timings: the bench's clock, read instead of the wall clock. Each reading moves
    it on by 1 ms; a SlowDrafter's step by 50 ms more."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


@pytest.fixture
def clock(monkeypatch) -> BenchClock:
    clock = BenchClock()
    monkeypatch.setattr(runner_mod, "time", clock)
    return clock


class SlowDrafter(Drafter, Session):
    """Plain decoding whose every step takes 50 ms of the bench's clock: the bench must see
    it slower (its own session: it holds nothing a reply changes)."""

    def __init__(self, clock: BenchClock) -> None:
        super().__init__()
        self.clock = clock

    def start(self, state, prefill) -> Session:
        return self

    def propose(self, state):
        self.clock.now += 0.05
        return super().propose(state)


def _corrupted(method: Contender) -> Contender:
    """The same method with its last token changed: a greedy mismatch to be reported."""

    def generate(prompt_ids):
        out = method.generate(prompt_ids)
        return Outcome([*out.ids[:-1], out.ids[-1] + 1], out.ttft_s, out.accepted)

    return Contender("corrupt", generate)


def test_bench_measures_slowdown_mismatch_and_writes_outputs(bundled_tokenizer, tmp_path,
                                                             clock):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)
    params = SamplingParams(max_new_tokens=8, seed=0)
    methods, skipped = build_methods(lm, ["hf", "vanilla", "medusa", "auto"], params)
    methods["slow"] = engine_method("slow", lm, params, SlowDrafter(clock))
    methods["corrupt"] = _corrupted(methods["vanilla"])
    report = bench_report(lm, TWO_PROMPTS, methods, skipped, params, {"command": "test"})

    assert set(report) >= {"machine", "settings", "methods"}
    assert {"cpu", "threads", "torch", "device"} <= set(report["machine"])
    figures = report["methods"]
    assert list(figures) == ["hf", "vanilla", "auto", "slow", "corrupt"]
    assert figures["auto"]["greedy_match_rate"] == 1.0
    used = [m["used"] for m in report["measurements"] if m["method"] == "auto"]
    # nothing trained: copies, the datastore (the other prompt's reply) or plain steps
    assert used and all(set(u) <= {"off", "copy", "datastore"} for u in used)
    assert all(sum(u.values()) > 0 for u in used)
    assert "- auto's steps by kind, per category: " in to_markdown(report)
    for f in figures.values():
        assert REPORT_KEYS <= set(f)
        assert set(f["by_category"]) == {"qa", "translation"}
        assert all(REPORT_KEYS - {"by_category"} <= set(c) for c in f["by_category"].values())
        assert len(f["ctar"]) == 6 and f["peak_mem_mb"] > 0
    # Figures come from the measurements: recompute one from the raw records.
    rows = [m for m in report["measurements"] if m["method"] == "slow"]
    # On the injected clock a call lasts 1 ms plus 50 ms per slowed step, exactly.
    assert all(m["wall_s"] == pytest.approx(0.001 + 0.05 * m["steps"]) for m in rows)
    assert figures["slow"]["tokens_per_s"] == pytest.approx(
        statistics.median(m["tokens"] / m["wall_s"] for m in rows), rel=1e-3)
    assert figures["slow"]["tokens_per_s"] < figures["vanilla"]["tokens_per_s"]
    assert figures["slow"]["speedup_vs_hf"] < figures["vanilla"]["speedup_vs_hf"]
    # The plain loop is exact in fp32; the corrupted method is reported as a mismatch.
    assert figures["vanilla"]["greedy_match_rate"] == 1.0
    assert figures["corrupt"]["greedy_match_rate"] == 0.0
    assert "medusa" in report["skipped"]

    written = write_report(report, tmp_path / "out")
    assert [p.name for p in written] == ["report.json", "report.md", "speedup.png", "ctar.png",
                                         "accepted_hist.png"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["methods"].keys() == \
        figures.keys()
    for png in written[2:]:
        assert png.read_bytes()[:8] == PNG_MAGIC
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| method | qa | translation | all |" in md
    assert "MISMATCH: corrupt differs from hf on 2 of 2 prompts" in md
    assert "medusa did not run" in md and "`test`" in md
    assert md == to_markdown(report, [p.name for p in written[2:]])


def test_passes_take_the_median_speed_with_fresh_methods(bundled_tokenizer, clock):
    """Each pass after the first runs a freshly built table; a prompt's speed is the median
    over the passes (a method slow in one pass of three is not reported slow)."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)
    params = SamplingParams(max_new_tokens=6, seed=0)
    built = []

    def table():
        methods, _ = build_methods(lm, ["hf", "vanilla"], params)
        if len(built) == 1:  # the second pass: vanilla is slowed down
            methods["vanilla"] = engine_method("vanilla", lm, params, SlowDrafter(clock))
        built.append(methods)
        return methods

    report = bench_report(lm, TWO_PROMPTS, table(), {}, params, {"command": "test"},
                          passes=3, fresh=table)
    assert len(built) == 3 and report["settings"]["passes"] == 3
    assert "3 passes, each with freshly built methods" in to_markdown(report)
    rows = [m for m in report["measurements"] if m["method"] == "vanilla"]
    assert len(rows) == 2  # one per prompt, merged over the passes
    for m in rows:
        speeds = m["passes_tokens_per_s"]
        assert len(speeds) == 3 and min(speeds) == speeds[1]  # the slowed pass
        assert m["tokens_per_s"] == pytest.approx(statistics.median(speeds), rel=1e-3)
        assert m["tokens_per_s"] > speeds[1]


# ---- the command ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(bundled_tokenizer, tmp_path_factory):
    """A tiny model saved as a model folder, loadable by --model (and as --assistant)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)
    lm.model.save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def two_prompt_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p.prompt, "category": p.category}) + "\n"
                         for p in TWO_PROMPTS), encoding="utf-8")
    return f


def test_bench_command_end_to_end(tiny_folder, two_prompt_file, tmp_path, capsys):
    out = tmp_path / "report"
    code = cli.main(["bench", "--model", str(tiny_folder), "--quant", "fp32", "--step", "eager",
                     "--prompts", str(two_prompt_file), "--max-new-tokens", "6",
                     "--methods", "hf,hf-lookup,hf-assisted,vanilla,kangaroo",
                     "--assistant", str(tiny_folder), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "| vanilla |" in captured.out  # the terminal table
    report = json.loads((out / "report.json").read_text())
    assert list(report["methods"]) == ["hf", "hf-lookup", "hf-assisted", "vanilla"]
    assert "kangaroo" in report["skipped"]
    assert report["settings"]["command"].startswith("python launcher.py bench --model ")
    assert report["methods"]["hf-assisted"]["mean_accepted"] >= 1.0
    assert all((out / name).is_file() for name in
               ("report.md", "speedup.png", "ctar.png", "accepted_hist.png"))


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found"),
    (["--methods", "hf,warp"], "unknown method 'warp'"),
    (["--methods", "hf-assisted"], "--assistant"),
    (["--max-new-tokens", "0"], "max new tokens"),
    (["--limit", "0"], "--limit"),
    (["--passes", "0"], "--passes"),
])
def test_bench_command_bad_input_is_one_line(extra, message, capsys):
    code = cli.main(["bench", "--model", "/nonexistent/model", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and message in err and "\n" not in err


# ---- the GPU entry and the scaled GGUF writer, kept working on the CPU ----------------

def test_gpu_script_runs_both_quantizations(tiny_folder, two_prompt_file, tmp_path):
    out = tmp_path / "gpu"
    # the eager step: the script's plumbing is under test, not compiling (a minute here)
    code = bench_gpu.main(["--model", str(tiny_folder), "--prompts", str(two_prompt_file),
                           "--methods", "hf,vanilla", "--max-new-tokens", "4", "--limit", "1",
                           "--step", "eager", "--out", str(out)])
    assert code == 0
    for quant in ("bf16", "nf4"):
        report = json.loads((out / quant / "report.json").read_text())
        assert report["settings"]["quant"] == quant
        assert report["settings"]["command"].startswith("python -m scripts.bench_gpu")
        assert (out / quant / "speedup.png").is_file()
    summary = (out / "summary.md").read_text()
    assert "## bf16" in summary and "## nf4" in summary and "| vanilla |" in summary


def test_gpu_script_rejects_a_single_quant_flag(tiny_folder):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--model", str(tiny_folder), "--quant", "nf4"])


@pytest.mark.slow
def test_the_scaled_gguf_writer_keeps_llama_cpps_4_bit_layout(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader

    path = tmp_path / "scaled.gguf"
    scaled_gguf.main(["--scale", "0.1", "--out", str(path)])  # a tenth: one or two layers
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    assert "output.weight" not in types  # a tied head is stored once, as the table
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_down.weight"] == (
        GGMLQuantizationType.Q4_0)


def test_the_datastore_never_holds_the_measured_prompts_own_reply(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)
    params = SamplingParams(max_new_tokens=8, seed=0)
    names = ["hf", "lookup", "datastore", "auto", "auto-no-datastore"]
    methods, skipped = build_methods(lm, names, params)
    held = methods["datastore"].held_out
    assert held is methods["auto"].held_out
    assert methods["lookup"].held_out is methods["auto-no-datastore"].held_out is None
    seen = []

    def checked(method):
        generate = method.generate

        def run(prompt_ids):
            own = held.replies[tuple(prompt_ids)]
            docs = [list(d) for d in held.store.docs]
            seen.append((own in docs, len(docs)))
            return generate(prompt_ids)

        method.generate = run

    for name in ("datastore", "auto"):
        checked(methods[name])
    report = bench_report(lm, TWO_PROMPTS, methods, skipped, params, {"command": "test"})
    measured = seen[len(seen) - 4:]  # after the warm-up calls: 2 prompts x 2 methods
    assert measured and not any(own for own, _n in measured)
    assert all(n == 1 for _own, n in measured)  # the other prompt's reply is there
    assert "leave-one-out" in report["settings"]["datastore"]["rule"]
    assert list(report["methods"]) == names
    assert "Datastore methods" in "\n".join(notes(report))

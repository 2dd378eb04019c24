"""The llama-bench peer: its JSON read into the report's `peers` section and the table's
"vs llama-bench" column, run before and after the methods; a missing or failing program is
one line. A fake llama-bench (a script printing what the real one prints) stands in."""

from __future__ import annotations

import stat
import sys

import pytest

from bench import llamabench
from bench.report import overall_table
from engine.errors import QuickdraftError

FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
assert value("-o") == "json" and value("-t") == "2"
if "-pg" in args:  # the reply: prompt then generation, tokens/s over both
    prompt, gen = (int(n) for n in value("-pg").split(","))
    rows = [{{"n_prompt": prompt, "n_gen": gen, "n_depth": 0,
              "avg_ts": (prompt + gen) / (gen / 50.0)}}]
else:
    sizes = [int(n) for n in value("-p").split(",")]
    rows = [{{"n_prompt": n, "n_gen": 0, "n_depth": int(value("-d")),
              "avg_ts": 100.0 * n ** 0.5}} for n in sizes]
    rows.append({{"n_prompt": 0, "n_gen": int(value("-n")), "n_depth": int(value("-d")),
                  "avg_ts": 80.0, "stddev_ts": 1.5}})
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
print(json.dumps(rows))
"""


@pytest.fixture
def fake(tmp_path):
    exe, log = tmp_path / "llama-bench", tmp_path / "calls.log"
    exe.write_text(FAKE.format(python=sys.executable, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return llamabench.LlamaBench(exe, gguf, threads=2), log


def test_measure_reads_generation_speed_and_step_costs(fake):
    peer, log = fake
    got = llamabench.measure(peer, depth=150, tokens=64)
    # the reply's new tokens over its whole time (the fake spends gen / 50 s on it)
    assert got["tokens_per_s"] == pytest.approx(50.0)
    assert got["decode_tokens_per_s"] == 80.0 and got["ms_per_token"] == pytest.approx(12.5)
    assert got["depth"] == 150 and got["tokens"] == 64
    assert got["step_ms"][1] == pytest.approx(10.0) and got["step_ms"][4] == pytest.approx(20.0)
    calls = log.read_text()
    assert "-d 150" in calls and "-n 64" in calls and "-pg 150,64" in calls


def test_llama_cpp_is_priced_on_the_methods_own_work(fake):
    """Replies that end early weigh their prompt more: llama.cpp reads each prompt and writes
    each reply's tokens at its measured speeds (the fake: 150 prompt tokens in 0.48 s,
    80 tokens/s after)."""
    run = llamabench.measure(fake[0], depth=150, tokens=64)
    assert run["prompt_s"] == pytest.approx(64 / 50 - 64 / 80)
    assert llamabench.same_work(run, [(150, 64)]) == pytest.approx(50.0)  # its own reply
    seconds = 0.48 + 32 / 80 + 0.24 + 10 / 80  # a 75-token prompt reads in half the time
    assert llamabench.same_work(run, [(150, 32), (75, 10)]) == pytest.approx(42 / seconds)


def test_the_table_compares_every_method_with_llama_bench(fake):
    peer, _ = fake
    runs = [llamabench.measure(peer, 150, 64) for _ in range(2)]
    figures = {"tokens_per_s": 100.0, "speedup_vs_hf": 1.0, "speedup_vs_hf_lookup": None,
               "mean_accepted": 1.0, "ctar": [], "ttft_s": 0.1, "peak_mem_mb": 10.0,
               "peak_mem_delta_mb": 1.0, "greedy_match_rate": 1.0, "prefix_match": 1.0}
    report = {"methods": {"vanilla": figures},
              "peers": {"llama-bench": {"tokens_per_s": 80.0, "runs": runs}}}
    header, _rule, row = overall_table(report)
    assert "vs llama-bench" in header and "1.25x" in row  # 100 tok/s over 80
    # a method whose replies were priced on their own (shorter replies: llama.cpp slower)
    figures["llama_bench_tokens_per_s"] = 50.0
    assert "2.00x" in overall_table(report)[2]


def test_a_missing_or_failing_program_is_one_line(tmp_path, fake):
    with pytest.raises(QuickdraftError, match="is not a file"):
        llamabench.find(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    broken.chmod(0o755)
    peer = llamabench.LlamaBench(broken, fake[0].gguf, 2)
    with pytest.raises(QuickdraftError, match="failed to load model"):
        llamabench.measure(peer, 10, 8)

"""The suite's own rules, checked on its source: every test can fail (it asserts, expects an
exception, skips with a reason, or calls a helper that asserts), and no wall clock decides a
test (no duration compared with a threshold, no sleep standing in for an event) outside a
helper whose docstring starts with "Injects timings:"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns"}
# pytest's expectations, torch's and numpy's comparisons, and Playwright's waits (they raise
# when the page never gets there)
EXPECTS = {"raises", "skip", "fail", "xfail", "warns", "importorskip", "wait_for_selector",
           "wait_for_function", "assert_close", "assert_equal", "assert_allclose",
           "assert_array_equal"}
MARKER = "Injects timings:"


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _called(node: ast.AST) -> set[str]:
    """Names of everything called in `node` (`f(...)` and `x.f(...)` both give "f")."""
    out = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            out.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return out


def asserting_helpers(trees: list[ast.AST]) -> set[str]:
    """Functions (in any of `trees`) that assert, directly or through one that does."""
    funcs = [f for t in trees for f in _functions(t)]
    found = {f.name for f in funcs if any(isinstance(n, ast.Assert) for n in ast.walk(f))}
    while True:  # the fixed point: helpers calling helpers
        more = {f.name for f in funcs if _called(f) & (found | EXPECTS)} - found
        if not more:
            return found
        found |= more


def _is_clock(node: ast.AST, clock_names: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in CLOCKS \
                and getattr(n.func.value, "id", None) == "time":
            return True
        if isinstance(n, ast.Name) and n.id in clock_names:
            return True
    return False


def _in_waits(func: ast.FunctionDef) -> set[int]:
    """ids of nodes inside a `while` loop: a loop that polls for an event until a hang guard
    runs out waits for the event; only what is asserted after it decides the test."""
    return {id(n) for w in ast.walk(func) if isinstance(w, ast.While) for n in ast.walk(w)}


def clock_problems(func: ast.FunctionDef) -> list[str]:
    """A duration compared with a threshold, or a sleep (outside a polling loop) followed by
    an assert."""
    if (ast.get_docstring(func) or "").startswith(MARKER):
        return []
    waits = _in_waits(func)
    clock_names: set[str] = set()
    for n in ast.walk(func):  # names holding clock readings or durations
        if isinstance(n, ast.Assign) and _is_clock(n.value, clock_names):
            clock_names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    problems = []
    for n in ast.walk(func):
        if isinstance(n, ast.Compare) and id(n) not in waits and any(
                _is_clock(side, clock_names) for side in [n.left, *n.comparators]):
            problems.append(f"line {n.lineno}: a wall-clock reading is compared")
    sleeps = [n.lineno for n in ast.walk(func) if isinstance(n, ast.Call)
              and getattr(n.func, "attr", None) == "sleep" and id(n) not in waits]
    asserts = [n.lineno for n in ast.walk(func) if isinstance(n, ast.Assert)]
    if sleeps and asserts and max(asserts) > min(sleeps):
        problems.append(f"line {min(sleeps)}: a sleep precedes an assert")
    return problems


def check(sources: dict[str, str], helpers_from: list[ast.AST] = ()) -> list[str]:
    """Every rule broken in `sources` ({file name: source}), one line each."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    helpers = asserting_helpers([*trees.values(), *helpers_from])
    problems = []
    for name, tree in trees.items():
        for func in _functions(tree):
            where = f"{name}::{func.name}"
            is_test = func.name.startswith("test_")
            if is_test and not _called(func) & (helpers | EXPECTS) and not any(
                    isinstance(n, ast.Assert) for n in ast.walk(func)):
                problems.append(f"{where}: nothing in it can fail")
            problems += [f"{where} {p}" for p in clock_problems(func)]
    return problems


def suite_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}


def test_the_suite_keeps_its_rules():
    assert check(suite_sources()) == []


BAD = '''
import time

def test_nothing_checked():
    x = 1 + 1

def test_timed():
    t0 = time.perf_counter()
    work()
    assert time.perf_counter() - t0 < 2

def test_duration_through_a_name():
    start = time.monotonic()
    work()
    took = time.monotonic() - start
    assert took < 0.5

def test_sleeps_then_asserts(service):
    service.start()
    time.sleep(1.0)
    assert service.busy
'''

GOOD = '''
import time
import pytest

def expect_two(x):
    assert x == 2

def check_it(x):
    expect_two(x)

def fake_clock():
    """Injects timings: each reading is one second after the last."""
    t = [0.0]
    def read():
        t[0] += 1.0
        return t[0]
    assert read() < 5
    return read

def test_through_a_helper():
    check_it(1 + 1)

def test_refusal():
    with pytest.raises(ValueError):
        int("x")

def test_skips():
    pytest.skip("needs a GPU")

def test_polls_for_an_event_with_a_hang_guard(service):
    deadline = time.monotonic() + 10
    while not service.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.busy
'''


@pytest.mark.parametrize("name", ["test_nothing_checked", "test_timed",
                                  "test_duration_through_a_name", "test_sleeps_then_asserts"])
def test_the_checker_catches_each_bad_test(name):
    problems = check({"bad.py": BAD})
    assert any(p.startswith(f"bad.py::{name}") for p in problems), problems


def test_the_checker_accepts_helpers_refusals_skips_and_marked_timings():
    assert check({"good.py": GOOD}) == []

"""The suite's own rules, checked on its source: every test can fail (it asserts, expects an
exception, skips with a reason, or calls a helper that asserts), and no wall clock decides a
test: no clock reading compared, no duration or speed the code under test measured
(`round_seconds(...)`, `x.tokens_per_s`, `m["wall_s"]`) ordered against a threshold or another
unless the test runs on injected timings, no sleep standing in for an event. Injected timings
come from a helper whose docstring starts with "Injects timings:" (or from what uses one)."""

from __future__ import annotations

import ast
import re
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
# Timers of the code under test, and the figures they fill in (durations and speeds).
TIMER = re.compile(r"seconds|elapsed|duration")
FIGURE = re.compile(r"(^|_)(s|ms|seconds|per_s)$")
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


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


def _is_measured(node: ast.AST, measured_names: set[str]) -> bool:
    """A duration or speed the code under test measured on the wall clock: a timer's result
    (`round_seconds(...)`), a figure named so (`x.tokens_per_s`, `m["wall_s"]`), or a name
    holding one."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and TIMER.search(_name(n.func)):
            return True
        if isinstance(n, ast.Attribute) and FIGURE.search(n.attr):
            return True
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) \
                and FIGURE.search(str(n.slice.value)):
            return True
        if isinstance(n, ast.Name) and n.id in measured_names:
            return True
    return False


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def injectors(trees: list[ast.AST]) -> set[str]:
    """Functions and classes whose docstring starts with MARKER, and those (fixtures,
    helpers) that call one: a test using any of them runs on injected timings."""
    defs = [n for t in trees for n in ast.walk(t)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    found = {d.name for d in defs if (ast.get_docstring(d) or "").startswith(MARKER)}
    while True:
        more = {d.name for d in defs if _called(d) & found} - found
        if not more:
            return found
        found |= more


def _in_waits(func: ast.FunctionDef) -> set[int]:
    """ids of nodes inside a `while` loop: a loop that polls for an event until a hang guard
    runs out waits for the event; only what is asserted after it decides the test."""
    return {id(n) for w in ast.walk(func) if isinstance(w, ast.While) for n in ast.walk(w)}


def _uses(func: ast.FunctionDef, names: set[str]) -> bool:
    params = {a.arg for a in func.args.args}
    return bool((params | _called(func)) & names)


def _assigned(func: ast.FunctionDef, test) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(func):  # names holding clock readings or durations
        if isinstance(n, ast.Assign) and test(n.value, names):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def clock_problems(func: ast.FunctionDef, injected: set[str] = frozenset()) -> list[str]:
    """A wall-clock reading compared, a measured duration or speed ordered against a
    threshold or another (unless the test runs on injected timings), or a sleep (outside a
    polling loop) followed by an assert."""
    if (ast.get_docstring(func) or "").startswith(MARKER):
        return []
    waits = _in_waits(func)
    clock_names = _assigned(func, _is_clock)
    measured_names = set() if _uses(func, injected) else _assigned(func, _is_measured)
    problems = []
    for n in ast.walk(func):
        if not isinstance(n, ast.Compare) or id(n) in waits:
            continue
        sides = [n.left, *n.comparators]
        if any(_is_clock(side, clock_names) for side in sides):
            problems.append(f"line {n.lineno}: a wall-clock reading is compared")
        elif not _uses(func, injected) and any(isinstance(o, ORDER) for o in n.ops) \
                and any(_is_measured(side, measured_names) for side in sides):
            problems.append(f"line {n.lineno}: a measured duration or speed is ordered")
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
    injected = injectors([*trees.values(), *helpers_from])
    problems = []
    for name, tree in trees.items():
        for func in _functions(tree):
            where = f"{name}::{func.name}"
            is_test = func.name.startswith("test_")
            if is_test and not _called(func) & (helpers | EXPECTS) and not any(
                    isinstance(n, ast.Assert) for n in ast.walk(func)):
                problems.append(f"{where}: nothing in it can fail")
            problems += [f"{where} {p}" for p in clock_problems(func, injected)]
    return problems


def suite_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(TESTS.rglob("*.py"))}


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

def test_a_timer_above_zero(lm):
    assert round_seconds(lm, drafter) > 0

def test_a_measured_figure_in_a_window(lm):
    per_token = prep_seconds_per_token(lm)
    assert 0 < per_token < 0.1

def test_speeds_ordered_on_the_wall_clock(report):
    assert report["slow"]["tokens_per_s"] < report["fast"]["tokens_per_s"]
    assert last.tokens_per_s > 0
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

class StepClock:
    """Injects timings: a clock that moves on by one second a reading."""

def clock(monkeypatch):
    return StepClock()

def test_speeds_ordered_on_an_injected_clock(report, clock):
    assert report["slow"]["tokens_per_s"] < report["fast"]["tokens_per_s"]

def test_a_measured_figure_compared_for_equality(lm):
    assert round_seconds(lm, drafter) == 0.5

def test_polls_for_an_event_with_a_hang_guard(service):
    deadline = time.monotonic() + 10
    while not service.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.busy
'''


@pytest.mark.parametrize("name", ["test_nothing_checked", "test_timed",
                                  "test_duration_through_a_name", "test_sleeps_then_asserts",
                                  "test_a_timer_above_zero", "test_a_measured_figure_in_a_window",
                                  "test_speeds_ordered_on_the_wall_clock"])
def test_the_checker_catches_each_bad_test(name):
    problems = check({"bad.py": BAD})
    assert any(p.startswith(f"bad.py::{name}") for p in problems), problems


def test_the_checker_accepts_helpers_refusals_skips_and_injected_timings():
    assert check({"good.py": GOOD}) == []

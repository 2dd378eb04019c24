"""Self-distilled data: seed and prompt files, generation in batches, resuming without
duplicates after an interruption, and the held-out split by seed."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
from types import SimpleNamespace

import pytest

from engine.errors import QuickdraftError
from engine.progress import Progress
from engine.prompt_files import PromptRecord, read_prompt_file
from tests.conftest import make_tiny_model
from trainer import answering
from trainer.features import conversation_tokens
from trainer.seeds import DataBudget, build_seeds
from trainer.selfdistill import generate_data, load_conversations, split_heldout

SMALL = DataBudget(max_conversations=6, batch_size=4, max_new_tokens=6, samples_per_seed=2)


@pytest.fixture(scope="module")
def lm(bundled_tokenizer):
    return make_tiny_model("llama-mha", bundled_tokenizer, num_layers=2)


def test_bundled_seeds_are_broad_and_include_multi_turn():
    seeds = build_seeds(None, DataBudget(samples_per_seed=1))
    categories = {s.category for s in seeds}
    assert len(seeds) >= 500
    assert {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
        "translation",
        "summarization",
        "qa",
        "multiturn",
    } <= categories
    assert any(len(s.turns) >= 2 for s in seeds)
    assert len({s.key for s in seeds}) == len(seeds)


def test_each_pass_samples_every_seed_again_with_its_own_key():
    one = build_seeds(None, DataBudget(samples_per_seed=1))
    two = build_seeds(None, DataBudget(samples_per_seed=2))
    assert len(two) == 2 * len(one) and len({s.key for s in two}) == len(two)
    assert {s.sample for s in two[: len(one)]} == {0}


def test_prompt_files_in_jsonl_and_plain_text(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        '{"prompt": "Name a colour.", "category": "qa"}\n\n{"turns": ["Hi", "And then?"]}\n'
    )
    assert read_prompt_file(jsonl, "user") == [
        PromptRecord(("Name a colour.",), "qa"),
        PromptRecord(("Hi", "And then?"), "user"),
    ]
    text = tmp_path / "p.txt"
    text.write_text("First prompt\n\nSecond prompt\n")
    assert [r.turns for r in read_prompt_file(text, "user")] == [("First prompt",),
                                                                 ("Second prompt",)]


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
        ('{"text": "no prompt key"}\n', 'line 1: no "prompt"'),
        ('{"turns": ["a"]}\n[1, 2]\n', "line 2: expected a JSON object"),  # not an object
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_get_one_clear_line(tmp_path, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(QuickdraftError, match=words) as err:
        read_prompt_file(path, "user")
    assert "\n" not in str(err.value)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(QuickdraftError, match="prompt file not found"):
        read_prompt_file(tmp_path / "nope.txt", "user")


def test_generation_writes_conversations_with_the_models_answers(lm, tmp_path):
    out = tmp_path / "conversations.jsonl"
    budget = DataBudget(max_conversations=40, batch_size=4, max_new_tokens=4)
    summary = generate_data(lm, out, None, budget, lambda p: None)
    convs = load_conversations(out)
    assert summary["conversations"] == len(convs) == 40 and summary["new"] == 40
    assert summary["tokens"] > 0
    for messages in convs:
        roles = [m["role"] for m in messages]
        assert roles[0] == "user" and roles == ["user", "assistant"] * (len(roles) // 2)
    multi = [m for m in convs if len(m) >= 4]  # answered turn by turn
    assert len(multi) == 4 and all(m[1]["content"] != m[3]["content"] for m in multi)


@pytest.mark.parametrize("rows", [True, False])
def test_the_progress_says_answer_tokens_a_minute(lm, tmp_path, monkeypatch, rows):
    """The data stage's progress line (the Train tab's and the command line's) gives the
    rate of the answers' tokens, not of the conversations' (prompts included), on the
    batched rows and on generate() alike."""
    monkeypatch.setattr(answering, "supports_rows", lambda lm: rows)
    out = tmp_path / "conversations.jsonl"
    budget = DataBudget(max_conversations=12, batch_size=4, max_new_tokens=4)
    reports = []
    summary = generate_data(lm, out, None, budget, reports.append)
    assert "answer tokens" not in reports[0].message  # nothing written yet: no rate
    message = reports[-1].message
    number, k = re.search(r"([0-9.]+)(k?) answer tokens/min", message).groups()
    rate = float(number) * (1000 if k else 1)
    answered = summary["tokens"]  # the answers' tokens, as the file counts them
    conversation = sum(conversation_tokens(lm, c) for c in load_conversations(out))
    assert answered < conversation / 2
    seconds = json.loads(out.with_suffix(".meta.json").read_text())["seconds"]  # 10 ms steps
    assert rate == pytest.approx(answered * 60 / seconds, rel=0.25)  # not conversation tokens


def test_the_data_stages_line_keeps_its_eta_on_a_terminal():
    import io

    from app.commands.progress_line import ProgressLine

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = ProgressLine(stream)
    bar(Progress("data", 500, 1000, "1708 conversations, 58.3k answer tokens/min",
                 eta_s=3599))
    assert "58.3k answer tokens/min" in stream.getvalue() and "ETA 59:59" in stream.getvalue()


def test_multi_turn_seeds_come_in_blocks_spread_through_each_pass():
    seeds = build_seeds(None, DataBudget(samples_per_seed=1, batch_size=8))
    multi = [i for i, s in enumerate(seeds) if len(s.turns) > 1]
    blocks = [multi[j : j + 8] for j in range(0, len(multi), 8)]
    assert all(b == list(range(b[0], b[0] + len(b))) for b in blocks)  # batched together
    n = len(seeds)
    assert multi[0] < n // 4 and any(n // 4 < b[0] < 3 * n // 4 for b in blocks)  # spread out
    assert len({s.category for s in seeds[:80]}) >= 8  # a short run still sees the breadth


def test_an_interrupted_run_resumes_without_duplicates(lm, tmp_path):
    out = tmp_path / "conversations.jsonl"
    cancel = threading.Event()

    def stop_after_a_batch(p):
        if p.done:  # the first report (0 done) comes before any batch
            cancel.set()

    first = generate_data(lm, out, None, SMALL, stop_after_a_batch, cancel)
    assert first["conversations"] == 4
    with out.open("a") as fh:
        fh.write('{"key": "torn", "messages": [{"role": "us')  # a kill mid-write
    assert len(load_conversations(out)) == 4  # the torn line is skipped
    second = generate_data(lm, out, None, SMALL, lambda p: None)
    keys = [json.loads(line)["key"] for line in out.read_text().splitlines()]
    assert second["new"] == 2 and len(keys) == 6 and len(set(keys)) == 6
    assert generate_data(lm, out, None, SMALL, lambda p: None)["new"] == 0  # target reached


def _ten_seconds_a_reading(monkeypatch) -> None:
    """Injects timings: each reading of the data stage's clock is ten seconds after the last,
    so a run's recorded time is never lost to rounding on a fast machine."""
    ticks = itertools.count(step=10)
    monkeypatch.setattr(answering, "time", SimpleNamespace(perf_counter=ticks.__next__))


def test_the_time_budget_counts_every_run_on_the_file(lm, tmp_path, monkeypatch):
    _ten_seconds_a_reading(monkeypatch)
    out = tmp_path / "conversations.jsonl"
    cancel = threading.Event()
    big = DataBudget(max_conversations=10**6, batch_size=2, max_new_tokens=4, max_seconds=600)
    first = generate_data(lm, out, None, big, lambda p: p.done and cancel.set(), cancel)
    spent = json.loads(out.with_suffix(".meta.json").read_text())["seconds"]
    assert first["new"] >= 1 and spent >= 10 and spent % 10 == 0 and first["seconds"] == spent
    # A budget this file has already used up adds nothing; a larger one carries on.
    used_up = dataclasses.replace(big, max_seconds=spent)
    assert generate_data(lm, out, None, used_up, lambda p: None)["new"] == 0
    more = dataclasses.replace(big, max_conversations=first["new"] + 2)
    assert generate_data(lm, out, None, more, lambda p: None)["new"] == 2


def test_user_prompts_join_the_seeds(lm, tmp_path):
    prompts = tmp_path / "mine.txt"
    prompts.write_text("Quickdraft user prompt one\nQuickdraft user prompt two\n")
    seeds = build_seeds([prompts], DataBudget(samples_per_seed=1))
    assert sum(s.category == "user" for s in seeds) == 2


def test_heldout_split_keeps_every_sample_of_a_seed_together(tmp_path):
    out = tmp_path / "conversations.jsonl"
    with out.open("w") as fh:
        for seed in range(200):
            for sample in range(3):
                messages = [
                    {"role": "user", "content": f"seed {seed}"},
                    {"role": "assistant", "content": f"answer {sample}"},
                ]
                fh.write(json.dumps({"key": f"{seed:012x}#{sample}", "messages": messages}) + "\n")
    train, heldout = split_heldout(out, 0.2)
    first_turn = lambda convs: {c[0]["content"] for c in convs}  # noqa: E731
    assert len(train) + len(heldout) == 600 and 10 < len(first_turn(heldout)) < 70
    assert not first_turn(train) & first_turn(heldout)
    assert len(heldout) == 3 * len(first_turn(heldout))


def test_the_budget_includes_what_the_features_will_cost(lm, tmp_path):
    out = tmp_path / "conversations.jsonl"
    budget = DataBudget(max_conversations=12, batch_size=2, max_new_tokens=4, max_seconds=600)
    assert generate_data(lm, out, None, budget, lambda p: None)["new"] == 12
    tokens = sum(conversation_tokens(lm, c) for c in load_conversations(out))
    # Reading the file's features would take the whole budget: nothing more is made.
    priced = dataclasses.replace(budget, max_conversations=24, prep_s_per_token=600 / tokens)
    assert generate_data(lm, out, None, priced, lambda p: None)["new"] == 0
    # Priced so that about half of those conversations use the budget up: a fresh file
    # stops there (the two rows under way may still end), where time alone would make 12.
    fresh = tmp_path / "fresh.jsonl"
    half = dataclasses.replace(budget, prep_s_per_token=1200 / tokens)
    assert 1 <= generate_data(lm, fresh, None, half, lambda p: None)["new"] <= 9


def test_a_line_with_history_seeds_its_user_turns_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "And then?", "history": [{"role": "user", "content": "Hi"}, '
                    '{"role": "assistant", "content": "Hello"}]}\n')
    seeds = build_seeds([path], DataBudget(samples_per_seed=1))
    assert [s.turns for s in seeds if "And then?" in s.turns] == [("Hi", "And then?")]

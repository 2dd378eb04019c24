"""The bench's prompt files: JSONL with categories and history, plain text, one-line errors
for bad files, the bundled set, and categories taken in turn."""

from __future__ import annotations

import pytest

from bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts, round_robin
from engine.errors import QuickdraftError


def test_jsonl_prompts_with_categories_and_history(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "Hi", "category": "chat", "history": '
        '[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
        "\n"
        '{"prompt": "2+2?"}\n', encoding="utf-8")
    first, second = load_prompts(f)
    assert first == BenchPrompt("Hi", "chat", ({"role": "user", "content": "a"},
                                               {"role": "assistant", "content": "b"}))
    assert second == BenchPrompt("2+2?", "general")


def test_plain_text_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("What is rust?\n\n  Write a haiku. \n{not json at all\n", encoding="utf-8")
    prompts = load_prompts(f)
    assert [p.prompt for p in prompts] == ["What is rust?", "Write a haiku.", "{not json at all"]
    assert {p.category for p in prompts} == {"general"}


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("\n  \n", "holds no prompts"),
    ('{"prompt": "a"}\n{"turns": ["b", "c"]}\n', "prompt 2 has several \"turns\""),
    ('{"prompt": "a"}\n{"prompt": \n', "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: no \"prompt\""),
    ('{"prompt": "a"}\n["b"]\n', "line 2: expected a JSON object"),
    ('{"prompt": "a", "history": [{"role": "bot", "content": "x"}]}\n', "line 1: \"history\""),
    ('{"prompt": "a", "category": 3}\n', "line 1: \"category\""),
    (b"\xff\xfe bad bytes", "not UTF-8"),
])
def test_bad_prompt_file_is_one_clear_line(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content, encoding="utf-8")
    with pytest.raises(QuickdraftError, match=message) as err:
        load_prompts(f)
    assert "\n" not in str(err.value)


def test_folder_given_as_prompt_file(tmp_path):
    with pytest.raises(QuickdraftError, match="is a folder"):
        load_prompts(tmp_path)


def test_bundled_prompt_set():
    prompts = load_prompts(DEFAULT_PROMPTS)
    counts = {c: sum(p.category == c for p in prompts) for c in {p.category for p in prompts}}
    assert counts == {c: 12 for c in ("chat", "translation", "summarization", "qa", "math",
                                      "rag", "coding")}
    assert all(p.history for p in prompts if p.category == "chat")


def test_round_robin_takes_categories_in_turn():
    prompts = [BenchPrompt(f"{c}{i}", c) for c in "abc" for i in range(3)]
    assert [p.prompt for p in round_robin(prompts)] == \
        ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    assert [p.prompt for p in round_robin(prompts, limit=4)] == ["a0", "b0", "c0", "a1"]
    with pytest.raises(QuickdraftError, match="--limit"):
        round_robin(prompts, limit=0)


# ---- the method table --------------------------------------------------------------------

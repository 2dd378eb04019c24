"""The datastore of the model's own outputs: its continuation trees, its cap, its file
(round trip; corrupt or foreign refused and rebuilt), lossless sampling with its drafts,
and learning from each finished reply so that a chat on a familiar topic drafts more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.service import Service
from app.store import Store
from engine.config import SamplingParams
from engine.datastore.load import load, open_store
from engine.datastore.memory import Datastore
from engine.datastore.params import DatastoreParams
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.drafters.datastore_source import StoreDrafter, store_file, tree_draft
from tests.conftest import make_tiny_model
from tests.stats_util import chi_square_pvalue, whole

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_longest_match_gives_a_tree_with_counts():
    store = Datastore("fp")
    store.add_all([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7], [8, 8, 3, 4, 6]])
    found = store.continuations([0, 2, 3, 4])
    assert found.match_len == 3  # (2, 3, 4): the 4-token context never occurred
    assert found.tokens[0] == 5 and found.counts[0] == 2  # 5 twice, 6 once after (2, 3, 4)
    assert found.probs[0] == pytest.approx(2 / 3)
    # the chance of being kept counts two more, unseen occurrences: 5 is kept with
    # 2 / (3 + 2), 6 with 1 / 5, and 7 (once of the 2 times after 5) with 2 / 5 * 1 / 4
    assert found.expected == pytest.approx([2 / 5, 1 / 5, 2 / 5 / 4])
    assert 6 in found.tokens and found.parents[found.tokens.index(6)] == -1  # a sibling
    draft = tree_draft(4, found, {})
    assert draft.tokens[0] == 4 and set(draft.tokens[1:]) == set(found.tokens)
    assert store.continuations([7, 7, 7]).tokens == []  # nothing matches
    once = Datastore("fp")
    once.add_all([[1, 2, 3, 4, 5, 6]])
    chain = once.continuations([0, 2, 3])  # seen once: its text, ever less certain
    assert chain.tokens == [4, 5, 6] and chain.probs == [1.0, 1.0, 1.0]
    assert chain.expected == pytest.approx([1 / 3, 1 / 9, 1 / 27])


def test_a_reply_is_searchable_as_soon_as_it_is_added():
    store = Datastore("fp")
    store.add_all([[1, 2, 3]])
    assert store.continuations([5, 6]).tokens == []
    store.add([5, 6, 7, 8])
    assert store.continuations([5, 6]).tokens[:2] == [7, 8]


def test_the_cap_puts_the_oldest_documents_out():
    store = Datastore("fp", DatastoreParams(max_tokens=100, recent_cap=30))
    for i in range(30):
        store.add([1000 + i, 1000 + i + 1, 7, 7])
    assert store.tokens <= 100
    assert store.continuations([1000, 1001]).tokens == []  # the first document is gone
    assert store.continuations([1029, 1030]).tokens[:1] == [7]  # the last one is there


def test_round_trip_and_refusals(tmp_path, caplog):
    path = tmp_path / "store.safetensors"
    store = Datastore("fp-a")
    store.add_all([[1, 2, 3, 4], [2, 3, 5]])
    store.add([4, 4, 2, 3, 9])  # in the recent tier
    store.save(path)
    again = load(path, "fp-a")
    for ctx in ([2, 3], [4, 4], [1, 2]):
        assert again.continuations(ctx) == store.continuations(ctx)
    with pytest.raises(ValueError, match="another model"):
        load(path, "fp-b")
    rebuilt = open_store(path, "fp-b", lambda: [[7, 8, 9]])  # foreign: rebuilt and saved
    assert rebuilt.continuations([7, 8]).tokens == [9]
    assert "another model" in caplog.text
    assert load(path, "fp-b").continuations([7, 8]).tokens == [9]
    path.write_bytes(path.read_bytes()[:40])  # corrupt
    with pytest.raises(ValueError, match="unreadable"):
        load(path, "fp-b")
    assert open_store(path, "fp-b", lambda: [[1, 5, 6]]).continuations([1, 5]).tokens == [6]




def test_a_newer_shipped_store_reaches_a_user_who_already_has_one(tmp_path):
    """An update ships a bigger store: a user's store started from the older one (or saved
    before stores recorded their start) is rebuilt from the new one plus what it learned
    from (their chats and training answers); once rebuilt it is opened as it is."""
    shipped, mine = tmp_path / "shipped.safetensors", tmp_path / "mine.safetensors"
    old = Datastore("fp")
    old.add_all([[1, 2, 3, 4], [7, 7, 1, 2, 9]])  # the older shipped store + a user's reply
    old.save(mine)
    new = Datastore("fp")
    new.add_all([[1, 2, 5, 6], [4, 4, 8, 8]])
    new.save(shipped)
    asked = []

    def sources():
        asked.append(1)
        return [[7, 7, 1, 2, 9]]

    store = open_store(mine, "fp", sources, fallback=shipped)
    assert store.continuations([4, 4]).tokens[:2] == [8, 8]  # the new shipped text
    assert store.continuations([7, 7]).tokens[:3] == [1, 2, 9]  # the user's reply kept
    assert store.continuations([2, 3]).tokens == []  # the old shipped text is gone
    again = open_store(mine, "fp", sources, fallback=shipped)
    assert asked == [1] and again.docs and again.seed == store.seed != ""
    assert again.continuations([4, 4]).tokens[:2] == [8, 8]
    old.save(mine)  # without sources nothing can be rebuilt: the user's store as it is
    assert open_store(mine, "fp", None, fallback=shipped).continuations([2, 3]).tokens == [4]


def test_a_save_that_fails_midway_keeps_the_old_store(tmp_path, monkeypatch):
    """A full disk while saving: the old file stays loadable and no temporary file is left."""
    import engine.datastore.disk as datastore_module

    path = tmp_path / "store.safetensors"
    store = Datastore("fp-a")
    store.add_all([[1, 2, 3, 4]])
    store.save(path)

    def half_written(arrays, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datastore_module, "save_file", half_written)
    store.add([1, 2, 7, 7])
    with pytest.raises(OSError, match="No space"):
        store.save(path)
    assert load(path, "fp-a").continuations([1, 2]).tokens[:2] == [3, 4]
    assert list(tmp_path.iterdir()) == [path]


def _second_token_counts(lm, prompt, store, n):
    counts = torch.zeros(8, dtype=torch.long)
    for seed in range(n):
        params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed)
        _t, ids, _ = run(lm, prompt, params, StoreDrafter(store, StepCost.linear(0.0)))
        counts[ids[1]] += 1
    return counts


def test_lossless_sampling_with_a_tree_of_drafts(bundled_tokenizer, monkeypatch):
    """Second-token frequencies with datastore trees (two children under the root) match
    the exact distribution, and the same test rejects a rule that accepts too eagerly."""
    from engine.decode import verify

    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=8)
    lm.eos_ids = ()
    prompt = [1, 2, 3, 1, 2]
    store = Datastore("t", DatastoreParams(min_prob=0.0))
    store.add_all([[2, t, 4, 5] for t in range(8)] + [[2, t, 6, 7] for t in range(8)])
    with torch.no_grad():
        first = lm.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = torch.zeros(8)
        for t in range(8):
            second += first[t] * lm.model(torch.tensor([prompt + [t]])).logits[0, -1].softmax(-1)
    # after (2, t) the drafter proposes two children, 4 and 6
    assert sorted(tree_draft(3, store.continuations([2, 3], max_depth=1), {}).tokens) == [3, 4, 6]
    counts = _second_token_counts(lm, prompt, store, 1000)
    assert chi_square_pvalue(counts, second) > 0.001

    fair = verify.accept_pointmass

    def eager(children, tokens, target_probs, generator):  # accepts with ~sqrt(p)
        root = whole(target_probs, len(tokens)).sqrt()
        return fair(children, tokens, root / root.sum(-1, keepdim=True), generator)

    monkeypatch.setattr(verify, "accept_pointmass", eager)
    assert chi_square_pvalue(_second_token_counts(lm, prompt, store, 1000), second) < 0.001


def test_chats_on_a_topic_make_the_next_one_draft_more(bundled_tokenizer, tmp_path):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    # Step costs as a bf16 CPU's, not timed: on a tiny model, timings on a loaded machine
    # can price every draft out, and this test is about what the store learns.
    lm.step_costs[lm.target.name] = StepCost()
    service = Service(Store(tmp_path / "data"), lm)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    from app.replies import ReplyRequest

    def ask(prompt):
        conv = service.store.new()
        return list(service.replies.chat(ReplyRequest(conv.id, greedy, "datastore"), prompt))[-1]

    before = ask("Tell me about the rivers of France.").stats
    assert service.accels.datastore.tokens > 0  # learnt when the reply finished
    assert store_file(lm).is_file()
    # (a tiny random model's replies share text only where its prompts do: the same
    # question again, in new chats)
    for _ in range(2):
        ask("Tell me about the rivers of France.")
    after = ask("Tell me about the rivers of France.").stats
    assert after.mean_accepted > before.mean_accepted
    assert after.datastore_accepted > 0

    service.store.remember(learn_from_chats=False)  # the same switch as training on chats
    tokens = service.accels.datastore.tokens
    ask("Tell me about the rivers of Poland.")
    assert service.accels.datastore.tokens == tokens


def test_a_growing_context_extends_the_last_match_and_finds_what_a_fresh_search_finds():
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 6, (60,), generator=gen).tolist() for _ in range(20)]
    store = Datastore("fp", DatastoreParams(max_match=6))
    store.add_all(docs[:-1])
    store.add(docs[-1])  # both tiers
    extended = 0
    for start in range(0, 40, 7):
        context = docs[3][start:start + 8]
        for step in range(12):  # grows by 0-2 tokens a step, often the store's own text
            context = context + torch.randint(0, 6, (step % 3,), generator=gen).tolist()
            if step % 2:
                context = context + docs[3][len(context):len(context) + 2]
            last = store._matcher._last
            got = store.continuations(context)
            extended += last is not None and store._matcher._last.m > last.m
            store._matcher._last = None
            assert got == store.continuations(context), (start, step)
    assert extended > 0

"""The data stage's continuous batching on the lean step's batched rows: rows refilled as
answers finish must answer each prompt exactly as it would be answered alone, on every
family the lean step runs, and the features they record must be the model's own."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch
from stats_util import chi_square_pvalue

from tests.engine.test_family_matrix import family_model
from trainer.sampler import AnswerJob, Record, SamplerConfig, answers, supports_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def alone(lm, prompt: list[int], max_new: int) -> list[int]:
    """Greedy answer of one prompt with no padding and no neighbours."""
    out = lm.model.generate(input_ids=torch.tensor([prompt], device=lm.device),
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                      device=lm.device),
                            do_sample=False, max_new_tokens=max_new,
                            eos_token_id=list(lm.eos_ids) or None, pad_token_id=0)
    answer = out[0, len(prompt):].tolist()
    return next((answer[:i] for i, t in enumerate(answer) if t in lm.eos_ids), answer)


def jobs(n: int, greedy: bool = True) -> list[AnswerJob]:
    """Prompts of different lengths and answer caps, so rows finish at different steps
    and refills join rows of different widths."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(5, 95, (3 + (i * 7) % 23,), generator=g).tolist()
        out.append(AnswerJob(prompt, greedy, 4 + (i * 5) % 13, tag=i))
    return out


def run_all(lm, todo: list[AnswerJob], batch: int, temperature: float = 0.7, seed: int = 0,
            record: Record | None = None, full: bool = False):
    gen = torch.Generator(device=lm.device).manual_seed(seed)
    config = SamplerConfig(batch_size=batch, temperature=temperature)
    return {job.tag: answer if full else answer.ids
            for job, answer in answers(lm, deque(todo), config, gen, lambda: True, record)}


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-untied", "qwen3-qknorm",
                                  "mistral-sliding", "gemma2-alternating"])
def test_greedy_rows_answer_as_each_prompt_alone(name, bundled_tokenizer):
    lm = family_model(name, bundled_tokenizer)
    assert supports_rows(lm)
    todo = jobs(11)
    got = run_all(lm, todo, batch=4)  # 11 jobs through 4 rows: every refill path runs
    assert sorted(got) == list(range(11))
    for job in todo:
        assert got[job.tag] == alone(lm, job.prompt, job.max_new), job.tag


def test_rows_end_at_eos_and_the_answer_leaves_it_out(bundled_tokenizer):
    lm = family_model("llama-gqa", bundled_tokenizer)
    todo = jobs(6)
    free = run_all(lm, todo, batch=3)
    eos = free[2][1]  # make the third answer's second token an end of turn
    lm = dataclasses.replace(lm, eos_ids=(eos,))
    got = run_all(lm, todo, batch=3)
    assert got[2] == free[2][:1]
    for job in todo:
        assert got[job.tag] == alone(lm, job.prompt, job.max_new)


def test_models_the_lean_step_does_not_run_are_answered_another_way(bundled_tokenizer):
    assert not supports_rows(family_model("gpt2-absolute", bundled_tokenizer))


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding"])
def test_recorded_features_are_the_models_own(name, bundled_tokenizer):
    """Each answer's recorded states and top-k logits at every position equal one forward
    of the model over prompt + answer (+ the end of turn), whatever row and step wrote them."""
    lm = family_model(name, bundled_tokenizer)
    todo = jobs(7)
    plain = run_all(lm, todo, batch=3)
    # an answer's third token becomes the end of turn: that answer ends early
    tag = next(t for t, a in plain.items() if len(a) > 2 and a[2] not in a[:2])
    eos = plain[tag][2]
    lm = dataclasses.replace(lm, eos_ids=(eos,))
    final = lm.model.config.num_hidden_layers
    got = run_all(lm, todo, batch=3, record=Record((1, final), topk=4), full=True)
    assert got[tag].ids == plain[tag][:2]
    for job in todo:
        answer = got[job.tag]
        f = answer.features
        ended = len(answer.ids) < job.max_new
        assert f.ids == job.prompt + answer.ids + ([eos] if ended else [])
        with torch.no_grad():
            out = lm.model(torch.tensor([f.ids]), output_hidden_states=True)
        for layer in (1, final):
            want = out.hidden_states[layer][0]
            if layer == final:  # transformers' last entry is the final normed state
                want = out.hidden_states[-1][0]
            assert f.states[layer].shape == want.shape
            torch.testing.assert_close(f.states[layer].float(), want, atol=3e-2, rtol=3e-2)
        top = out.logits[0].topk(4, dim=-1)
        assert torch.equal(f.top_ids.long(), top.indices), job.tag
        torch.testing.assert_close(f.top_logits.float(), top.values, atol=2e-2, rtol=2e-3)


def test_sampled_rows_draw_from_the_model_distribution(bundled_tokenizer):
    """Many copies of one prompt beside greedy rows of other lengths: the first token drawn
    follows softmax(logits / T) of the model run alone."""
    lm = family_model("llama-gqa", bundled_tokenizer)
    temperature = 1.5  # flatter than the random model's own peaks: many outcomes
    prompt = [11, 12, 13, 14, 15]
    n = 600
    todo = [AnswerJob(prompt, False, 2, tag=("s", i)) for i in range(n)]
    todo += [AnswerJob(j.prompt, True, j.max_new, tag=("g", j.tag)) for j in jobs(30)]
    order = [todo[i] for i in torch.randperm(len(todo), generator=torch.Generator().manual_seed(0))]
    got = run_all(lm, order, batch=16, temperature=temperature)
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt])).logits[0, -1]
    want = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(torch.tensor([got[("s", i)][0] for i in range(n)]),
                            minlength=want.numel())
    # A sampler reading another row's logits, or the padding's, fails this at once.
    assert chi_square_pvalue(counts, want) > 1e-3
    for tag, answer in got.items():
        if tag[0] == "g":
            job = next(j for j in todo if j.tag == tag)
            assert answer == alone(lm, job.prompt, job.max_new)


def test_stopping_drops_unfinished_answers(bundled_tokenizer):
    lm = family_model("llama-gqa", bundled_tokenizer)
    calls = {"n": 0}

    def keep_going() -> bool:
        calls["n"] += 1
        return calls["n"] < 6

    gen = torch.Generator().manual_seed(0)
    done = list(answers(lm, deque(jobs(8)), SamplerConfig(batch_size=4), gen, keep_going))
    assert all(len(a.ids) == job.max_new or a.ids == alone(lm, job.prompt, job.max_new)
               for job, a in done)
    assert len(done) < 8



def test_rows_are_capped_by_free_accelerator_memory(bundled_tokenizer, monkeypatch):
    from types import SimpleNamespace

    from trainer import sampler

    lm = family_model("llama-gqa", bundled_tokenizer)  # 4 layers, 2 KV heads of 16
    assert sampler.rows_that_fit(lm, 64, 1000) == 64  # the CPU: no cap here
    gpu = SimpleNamespace(model=lm.model, device=torch.device("cuda"), dtype=torch.bfloat16)
    per_row = 2 * 4 * 2 * 16 * 1000 * 2  # K and V, layers, heads, dims, positions, bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (per_row * 20, 10**12))
    assert sampler.rows_that_fit(gpu, 64, 1000) == 10  # half the free memory
    assert sampler.rows_that_fit(gpu, 8, 1000) == 8

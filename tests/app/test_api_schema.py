"""Request parsing of the OpenAI-compatible API, and the routes without a key (loopback) on a
tiny model through FastAPI's test client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api import ApiOptions, mount
from app.api.completions import EmbeddingRequest, TextRequest
from app.api.errors import ApiError
from app.api.schema import parse, parse_body
from app.api.worker import END, Reply, ReplyWorker
from app.host import model_name
from app.service import Service
from app.store import Store
from engine.config import ChatMessage, ChatPrompt, SamplingParams
from engine.decode.chat_template import encode
from engine.decode.generate import run
from tests.conftest import make_tiny_model

USER = {"role": "user", "content": "hi"}


def test_parse_maps_openai_fields():
    req = parse({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                     {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi."}, USER],
        "temperature": 0, "top_p": 0.5, "max_tokens": 9, "max_completion_tokens": 7,
        "stop": "\n", "seed": 3, "stream": True, "stream_options": {"include_usage": True},
        "accel": "lookup"}, 256)
    assert req.system == "Be brief.\n\nBe kind."
    assert [m.content for m in req.messages] == ["Hello there", "Hi.", "hi"]
    p = req.params
    assert (p.temperature, p.top_p, p.max_new_tokens, p.stop, p.seed) == (0, 0.5, 7, ("\n",), 3)
    assert req.accel == "lookup" and req.stream and req.include_usage


def test_parse_defaults():
    req = parse({"messages": [USER]}, 256)
    assert req.model is None and req.accel == "auto" and not req.stream
    assert req.params.temperature == 1.0 and req.params.max_new_tokens == 256


@pytest.mark.parametrize("body,param", [
    ([], None),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "system", "content": "only a system prompt"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [USER], "temperature": True}, "temperature"),
    ({"messages": [USER], "top_p": -0.1}, "top_p"),
    ({"messages": [USER], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [USER], "seed": 1.5}, "seed"),
    ({"messages": [USER], "n": 5}, "n"),
    ({"messages": [USER], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [USER], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": [USER], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [USER], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [USER], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [USER], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [USER], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [USER], "stream": "yes"}, "stream"),
    ({"messages": [USER], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ({"messages": [{**USER, "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}, USER]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [USER], "tools": [{"function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"messages": [USER], "accel": "warp"}, "accel"),
    ({"messages": [USER], "logit_bias": {"x" * 100 + "\n": True}}, "logit_bias"),
    ({"messages": [USER], "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"messages": [USER], "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"messages": [USER], "logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"messages": [USER], "logit_bias": [5]}, "logit_bias"),
    ({"messages": [USER], "response_format": "json_schema"}, "response_format"),
    ({"messages": [USER], "response_format": "text"}, "response_format"),
])
def test_parse_refuses_with_the_parameter_named(body, param):
    """The param is the field's path as OpenAI writes it; the message is one line of our
    own words that starts with it (never the validator's)."""
    with pytest.raises(ApiError) as err:
        parse(body, 256)
    assert err.value.status == 400 and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}
    assert err.value.message.startswith(param or "the request body")
    assert "Input should" not in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("model,body,param", [
    (TextRequest, {"prompt": "a", "echo": True}, "echo"),
    (TextRequest, {"prompt": "a", "best_of": 2}, "best_of"),
    (TextRequest, {"prompt": ["a", "b"]}, "prompt"),
    (TextRequest, {"prompt": "a", "suffix": "\ud800"}, "suffix"),
    (TextRequest, {"prompt": "a", "logprobs": 6}, "logprobs"),
    (TextRequest, {}, "prompt"),
    (EmbeddingRequest, {"input": ["a", ""]}, "input"),
    (EmbeddingRequest, {"input": "a", "encoding_format": "hex"}, "encoding_format"),
    (EmbeddingRequest, {"input": "a", "dimensions": 1.5}, "dimensions"),
])
def test_completions_and_embeddings_refuse_with_the_parameter_named(model, body, param):
    with pytest.raises(ApiError) as err:
        parse_body(model, body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_a_completions_body_maps_to_sampling_params():
    req = parse_body(TextRequest, {"prompt": ["hi"], "max_tokens": 5, "logprobs": 2,
                                   "stop": "x", "temperature": 0})
    params = req.params(req.logprobs)
    assert req.prompt == "hi" and (params.max_new_tokens, params.logprobs, params.stop,
                                   params.temperature) == (5, 2, ("x",), 0.0)


@pytest.mark.parametrize("raw,param", [
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"temperature": 1e400', "temperature"), ('"temperature": 1' + "0" * 400, "temperature"),
    ('"top_p": NaN', "top_p"), ('"top_p": -Infinity', "top_p"),
    ('"max_tokens": NaN', "max_tokens"), ('"max_completion_tokens": Infinity',
                                         "max_completion_tokens"),
    ('"seed": NaN', "seed"), ('"n": NaN', "n"), ('"presence_penalty": NaN', "presence_penalty"),
])
def test_a_number_that_is_not_finite_is_refused_naming_it(raw, param):
    """Python's JSON reader takes NaN, Infinity and 1e400 (inf): each is a 400, never a
    crash further on."""
    body = json.loads('{"messages": [{"role": "user", "content": "hi"}], ' + raw + "}")
    with pytest.raises(ApiError) as err:
        parse(body, 256)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("extra,param,words", [
    ({"temperature": 2.5}, "temperature", "in [0, 2]"),
    ({"temperature": -1e-300}, "temperature", "in [0, 2]"),
    ({"temperature": 1, "top_p": 1.5}, "top_p", "in [0, 1]"),
])
def test_values_outside_openais_ranges_are_refused_naming_them(extra, param, words):
    with pytest.raises(ApiError) as err:
        parse({"messages": [USER], **extra}, 256)
    assert err.value.param == param and words in err.value.message


def test_openais_full_ranges_and_sampling_options_are_taken():
    req = parse({"messages": [USER], "temperature": 1e-300, "top_p": 0, "n": 2,
                 "presence_penalty": -2, "frequency_penalty": 1.5, "logit_bias": {"17": -100},
                 "logprobs": True, "top_logprobs": 3, "unknown_field": [1]}, 256)
    p = req.params
    assert (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty) == \
        (1e-300, 0.0, -2.0, 1.5)
    assert p.logit_bias == ((17, -100.0),) and p.logprobs == 3 and req.n == 2


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": "hi \ud800"}], "messages[0].content"),
    ([{"role": "system", "content": "be \udfff"}, USER], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
     "messages[0].content"),
])
def test_text_that_is_not_valid_unicode_is_refused_naming_it(messages, param):
    """A lone surrogate (as the JSON escape "\\ud800" reads) no tokenizer takes."""
    with pytest.raises(ApiError) as err:
        parse({"messages": messages}, 256)
    assert err.value.status == 400 and err.value.param == param
    assert "lone surrogate" in err.value.message


@pytest.fixture
def app(tmp_path, bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    app = FastAPI()
    worker = mount(app, Service(Store(tmp_path / "data"), lm), ApiOptions(api_key=None))
    yield app, lm
    worker.close()


@pytest.fixture
def served(tmp_path, bundled_tokenizer):
    """A test client on a tiny model whose id is a path (its short name is the last part)."""
    lm = dataclasses.replace(make_tiny_model("llama-mha", bundled_tokenizer),
                             model_id="/models/org/tiny-chat")
    app, service = FastAPI(), Service(Store(tmp_path / "data"), lm)
    worker = mount(app, service, ApiOptions(api_key=None))
    yield TestClient(app), service
    worker.close()


ASK = {"temperature": 0, "max_tokens": 4, "accel": "off", "messages": [USER]}
# A failure that is not the client's: one line, with the id its traceback is logged under.
INTERNAL = re.compile(r"The reply failed unexpectedly \(error [0-9a-f]{8}\): the app's log "
                      r"has the details\.")


def _stream_lines(client, body) -> list[str]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_a_body_that_is_not_json_gets_an_openai_error(served):
    client, _service = served
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]


def test_the_model_answers_to_its_id_its_short_name_and_default(served):
    client, service = served
    assert model_name(service.host.lm) == "tiny-chat"
    for name in ("/models/org/tiny-chat", "tiny-chat", "default"):
        r = client.post("/v1/chat/completions", json={**ASK, "model": name})
        assert r.status_code == 200, (name, r.text)
    r = client.post("/v1/chat/completions", json={**ASK, "model": "org"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_generation_error_is_one_openai_error_and_the_worker_survives_it(served, monkeypatch):
    client, service = served
    real = service.replies.complete
    failures = iter([RuntimeError("boom\ntrace"), RuntimeError("bang")])

    def failing(*args):
        exc = next(failures, None)
        if exc is not None:
            raise exc
        yield from real(*args)

    monkeypatch.setattr(service.replies, "complete", failing)
    r = client.post("/v1/chat/completions", json=ASK)  # a whole reply
    assert r.status_code == 500
    error = r.json()["error"]  # one generic line: the exception's text stays in the log
    assert INTERNAL.fullmatch(error.pop("message"))
    assert error == {"type": "server_error", "param": None, "code": "internal_error"}
    lines = _stream_lines(client, ASK)  # a streamed one: the error is a chunk, then the end
    errors = [json.loads(line[6:]) for line in lines if '"error"' in line]
    assert len(errors) == 1 and INTERNAL.fullmatch(errors[0]["error"]["message"])
    assert "bang" not in "".join(lines) and "boom" not in r.text
    assert lines[-1] == "data: [DONE]"
    after = client.post("/v1/chat/completions", json=ASK)  # the worker is still serving
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("size", [512, 10**30])
def test_max_tokens_beyond_the_context_is_400_before_a_stream_starts(served, key, size):
    """Whole or streamed, the same 400 naming the parameter (the tiny model's window is
    512): a stream never opens with 200 to end in an error chunk."""
    client, service = served
    for stream in (False, True):
        r = client.post("/v1/chat/completions",
                        json={**ASK, "max_tokens": None, key: size, "stream": stream})
        assert r.status_code == 400, (stream, r.text[:200])
        assert r.json()["error"]["param"] == key and "context" in r.json()["error"]["message"]


def test_a_reply_cancelled_before_its_turn_never_runs():
    calls = []

    class Recording:
        def complete(self, *args):
            calls.append(args)
            yield from ()

    worker = ReplyWorker(Recording())

    async def ask() -> object:
        reply = Reply(parse({"messages": [USER]}, 8), asyncio.get_running_loop())
        reply.cancel.set()  # its client left while it waited
        worker.submit(reply)
        return await asyncio.wait_for(reply.events.get(), 30)

    try:
        assert asyncio.run(ask()) is END
    finally:
        worker.close()
    assert calls == []


def test_loopback_without_a_key_serves_whole_and_streamed_replies(app):
    app, lm = app
    client = TestClient(app)
    body = {"model": "tiny-llama-mha", "temperature": 0, "max_tokens": 8, "accel": "off",
            "messages": [USER]}
    ids = encode(lm.tokenizer, ChatPrompt((ChatMessage("user", "hi"),)))
    text, tokens, _stats = run(lm, ids, SamplingParams(max_new_tokens=8))
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["message"]["content"] == text
    assert whole["quickdraft"]["token_ids"] == tokens
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama-mha"

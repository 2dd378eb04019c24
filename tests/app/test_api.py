"""The OpenAI-compatible API on a live server (127.0.0.1, bundled model, fp32), driven by the
official `openai` client and by raw HTTP: whole and streamed replies, greedy output equal to
`chat --json`, the shared queue with the page's replies, a 20-client load test, client
disconnects, and every refusal in OpenAI's error shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from app.cli import main as cli_main
from app.ui.launch import LaunchOptions, check_api_key, check_exposure, launch
from engine.config import ModelSpec, SamplingParams
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.errors import QuickdraftError
from tests.paths import ROOT

pytestmark = pytest.mark.slow
KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a free loopback port, in this process, with the bundled model in fp32."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path_factory.mktemp("api-data")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
        options = LaunchOptions(open_browser=False, model=ModelSpec(quant="fp32"), api_key=KEY)
        demo, url, service = launch(options, block=False)
        try:
            yield demo, url.rstrip("/"), service
        finally:
            demo.close()


@pytest.fixture(scope="module")
def service(server):
    return server[2]


# Fields the server adds beside OpenAI's (the queue ticket of a streamed reply).
EXTENSIONS = {"quickdraft"}


def _extras(model) -> set[str]:
    """Fields of `model` (and the models inside it) that OpenAI's types do not declare."""
    from pydantic import BaseModel

    found = set(model.model_extra or {})
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                found |= _extras(item)
    return found


def assert_openai_shape(payload: dict) -> None:
    """`payload` (one response body or stream chunk) is exactly one of OpenAI's types: strict
    types, every required field, nothing undeclared but the server's own extension."""
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if "error" in payload:
        assert set(payload["error"]) >= {"message", "type", "code"}, payload
        return
    kinds = {"chat.completion": ChatCompletion, "chat.completion.chunk": ChatCompletionChunk,
             "list": None}
    assert payload.get("object") in kinds, payload
    if payload["object"] == "list":
        items = [Model.model_validate(m, strict=True) for m in payload["data"]]
    else:
        items = [kinds[payload["object"]].model_validate(payload, strict=True)]
    assert all(_extras(item) <= EXTENSIONS for item in items), payload


class _Checking(httpx.HTTPTransport):
    """Reads each response whole and checks its shape before the client parses it."""

    def handle_request(self, request):
        response = super().handle_request(request)
        body = response.read()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in body.decode().splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert_openai_shape(json.loads(line[6:]))
        elif body:
            assert_openai_shape(json.loads(body))
        checked.append(request.url.path)
        return httpx.Response(response.status_code, headers=response.headers, content=body,
                              request=request)


checked: list[str] = []  # paths whose responses were checked (the check itself is tested)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=120,
                  http_client=httpx.Client(transport=_Checking()))


def test_the_shape_check_refuses_a_missing_field_a_wrong_type_and_an_extra():
    good = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "hi"}}]}
    assert_openai_shape(good)
    for bad in ({k: v for k, v in good.items() if k != "created"}, {**good, "created": "1"},
                {**good, "choices": [{**good["choices"][0], "surprise": 1}]}):
        with pytest.raises((AssertionError, ValueError)):
            assert_openai_shape(bad)


def _reference(lm, prompt: str, max_new: int) -> tuple[str, list[int]]:
    ids = encode(lm.tokenizer, conversation(prompt))
    text, out, _stats = run(lm, ids, SamplingParams(max_new_tokens=max_new))
    return text, out


# -- the openai client ----------------------------------------------------------------------

def test_models_and_a_whole_reply(client, service):
    checked.clear()
    models = client.models.list()
    assert [m.id for m in models.data] == [service.host.lm.model_id]
    reply = client.chat.completions.create(
        model=models.data[0].id, messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": PROMPT}],
        temperature=0, max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    extra = reply.model_extra["quickdraft"]
    assert extra["accel"].startswith("auto") and extra["tokens_per_step"] >= 1
    assert checked == ["/v1/models", "/v1/chat/completions"]  # both shapes were checked


def test_streaming_reply_matches_the_whole_one(client):
    kwargs = dict(model="default", messages=[{"role": "user", "content": PROMPT}],
                  temperature=0, max_completion_tokens=16, extra_body={"accel": "off"})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True},
                                                 **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-2].model_extra["quickdraft"]["accel"] == "off"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 16


def test_greedy_api_output_equals_chat_json(client, service, tmp_path):
    """Token for token, fp32, with Auto acceleration (lossless) against the plain CLI."""
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1", "HF_HUB_OFFLINE": "1",
           "QUICKDRAFT_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "launcher.py"), "chat", "--prompt", PROMPT,
                          "--quant", "fp32", "--max-new-tokens", "40", "--json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cli = json.loads(out.stdout)
    reply = client.chat.completions.create(model="default", temperature=0, max_tokens=40,
                                           messages=[{"role": "user", "content": PROMPT}])
    assert reply.model_extra["quickdraft"]["token_ids"] == cli["token_ids"]
    assert reply.choices[0].message.content == cli["text"]


def test_stop_and_seed_are_honoured(client):
    ask = dict(model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=24)
    full = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
    cut = full.split()[2]
    stopped = client.chat.completions.create(temperature=0, stop=[cut], **ask).choices[0]
    assert stopped.finish_reason == "stop" and cut not in stopped.message.content
    assert full.startswith(stopped.message.content)
    # A seed repeats a sampled reply for a given acceleration (each drafter draws from the
    # seeded stream differently).
    sampled = [client.chat.completions.create(temperature=1.2, top_p=0.9, seed=7,
                                              extra_body={"accel": "lookup"}, **ask)
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


# -- raw HTTP: refusals in OpenAI's shape ---------------------------------------------------

BAD_REQUESTS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "accel": "warp"}, 400, "accel"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope/nothing"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(server[1] + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status
    assert_openai_shape(r.json())
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and "\n" not in error["message"]


def test_a_missing_or_wrong_key_is_401(server):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong-key-000"}):
        r = httpx.post(server[1] + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server[1] + "/v1/models").status_code == 401


def test_wrong_keys_from_another_local_program_do_not_lock_out_the_right_one(server):
    """Every local client is 127.0.0.1: a key in use keeps working while guesses wait."""
    url = server[1]
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200

    def guess(i: int) -> int:
        headers = {"Authorization": f"Bearer guess-{i:04}"}
        return httpx.get(url + "/v1/models", headers=headers).status_code

    codes = [guess(i) for i in range(6)]  # earlier tests' wrong keys may count already
    assert 429 in codes and set(codes[:codes.index(429)]) == {401}
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert guess(6) == 429


def test_503_while_a_model_loads(server, service):
    from app.jobs import Job

    before, service.host.loading = service.host.loading, Job("load", "some/model")
    try:
        r = httpx.get(server[1] + "/v1/models", headers=AUTH)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    finally:
        service.host.loading = before


def test_no_key_off_loopback_is_refused_at_start(capsys):
    assert cli_main(["serve", "--host", "0.0.0.0", "--auth", "me:secret"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["serve", "--host", "0.0.0.0", "--api-key", "0123456789"]) == 2
    assert "--auth" in capsys.readouterr().err  # the page's login stays required
    check_exposure("0.0.0.0", ("me", "secret"), check_api_key("0123456789"))
    check_exposure("127.0.0.1", None, None)  # loopback: neither is needed
    with pytest.raises(QuickdraftError, match="at least 8"):
        check_api_key("short")


# -- the queue ------------------------------------------------------------------------------

def _stream(url: str, prompt: str, max_tokens: int, record: dict) -> None:
    """One raw SSE client: its text and when its first and last content arrived."""
    body = {"model": "default", "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "accel": "off", "messages": [{"role": "user", "content": prompt}]}
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                record["done"] = True
                break
            chunk = json.loads(line[6:])
            assert_openai_shape(chunk)
            if "quickdraft" in chunk:
                record["ticket"] = chunk["quickdraft"]["queue_ticket"]
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                record.setdefault("first", time.monotonic())
                record["last"] = time.monotonic()
                parts.append(delta)
    record["text"] = "".join(parts)


def test_api_and_page_replies_queue_and_both_complete(server, service):
    """A reply asked on the page (through Gradio's own client, as the browser does) and one
    asked through the API at the same time: they queue, and each gets its own text."""
    from gradio_client import Client

    page_prompt = "Tell me about the sea."
    page_client = Client(server[1] + "/", verbose=False)
    page: dict = {}

    def on_update(*_outputs):
        page.setdefault("first", time.monotonic())
        page["last"] = time.monotonic()

    # the page's Send: message, system, temperature, top-p, top-k, max new tokens, acceptance
    job = page_client.submit(page_prompt, "", 0.0, 1.0, 0, 40, "auto", api_name="/send",
                             result_callbacks=[on_update])
    while not service.host.busy:  # the page's reply holds the model now
        time.sleep(0.005)
    api: dict = {}
    _stream(server[1], PROMPT, 12, api)
    chat = job.result(timeout=120)[0]
    assert chat[-1]["content"][0]["text"] == _reference(service.host.lm, page_prompt, 40)[0]
    assert api["text"] == _reference(service.host.lm, PROMPT, 12)[0] and api.get("done")
    # the API's reply waited for the page's (asked while the page's held the model)
    assert api["first"] >= page["first"]


def test_twenty_streaming_clients_each_get_their_own_text_in_order(server, service):
    prompts = [f"Say something about the number {i}." for i in range(20)]
    expected = [_reference(service.host.lm, p, 6)[0] for p in prompts]
    _stream(server[1], "warm up", 6, {})
    rss = psutil.Process().memory_info().rss
    records = [{} for _ in prompts]
    threads = []
    for prompt, record in zip(prompts, records, strict=True):
        threads.append(threading.Thread(target=_stream, args=(server[1], prompt, 6, record)))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert [r["text"] for r in records] == expected
    served = sorted(records, key=lambda r: r["first"])
    assert [r["ticket"] for r in served] == sorted(r["ticket"] for r in records)  # queue order
    pairs = zip(served, served[1:], strict=False)
    assert all(b["first"] >= a["last"] for a, b in pairs)  # one at a time, never interleaved
    after = psutil.Process().memory_info().rss  # memory is the bench's: printed, not judged
    print(f"rss before {rss / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB")


def _wait_until_free(service, what: str) -> None:
    """Wait (5 s at most) for the host to end the reply of a client that hung up; the
    caller asserts it did, and the time it took is printed, never asserted."""
    hung_up = time.monotonic()
    while service.host.busy and time.monotonic() - hung_up < 5:
        time.sleep(0.01)
    freed = time.monotonic() - hung_up
    print(f"{what}: queue freed {freed * 1000:.0f} ms after the client hung up")


def test_a_client_that_disconnects_frees_the_queue(server, service):
    body = {"model": "default", "stream": True, "temperature": 0, "max_tokens": 400,
            "accel": "off", "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.stream("POST", server[1] + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += '"content": "' in line and '"content": ""' not in line
            if seen >= 3:
                break  # hang up mid-reply
        assert service.host.busy
    _wait_until_free(service, "stream")
    assert not service.host.busy  # the 400-token reply ended early: its client had gone
    record: dict = {}
    _stream(server[1], PROMPT, 4, record)
    assert record.get("done") and record["text"]


def test_a_whole_reply_whose_client_hangs_up_is_cancelled(server, service):
    """Without streaming the server notices the hang-up by polling the connection."""
    import socket
    from urllib.parse import urlparse

    body = json.dumps({"model": "default", "temperature": 0, "max_tokens": 400, "accel": "off",
                       "messages": [{"role": "user", "content": "Write a long story."}]})
    where = urlparse(server[1])
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 10
        while not service.host.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.host.busy
    _wait_until_free(service, "whole reply")
    assert not service.host.busy

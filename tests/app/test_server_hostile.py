"""The running server (loopback, an API key, a tiny model) against what a local program can
send and what can sit in its data folder: lockouts keyed on the connection whatever
X-Forwarded-For says, the key in every form the route reads, no monitoring dashboard,
/v1 bodies of every wrong kind answered 4xx without Python's words, stop strings with lone
surrogates refused, broken or blocking accelerator files kept out of every reply, and a
client that hangs up during a long prompt freeing the model at the next chunk."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from app.security import Limits
from app.ui.launch import LaunchOptions, launch
from engine.config import ModelSpec
from engine.drafters.accelerators import INFO, METRICS, WEIGHTS, checkpoint_dir
from tests.app.test_page_events import PYTHONISMS
from tests.conftest import make_tiny_model

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_tokenizer):
    tiny = make_tiny_model("llama-mha", bundled_tokenizer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path_factory.mktemp("hostile-data")))
        mp.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
        mp.delenv("QUICKDRAFT_ORIGINS", raising=False)
        mp.setattr("app.host.load_model", lambda spec, report=None: tiny)
        options = LaunchOptions(open_browser=False, model=ModelSpec(), api_key=KEY,
                                limits=Limits(header_timeout_s=5, body_timeout_s=5))
        demo, url, service = launch(options, block=False)
        try:
            yield url.rstrip("/"), service
        finally:
            demo.close()


def _post(url: str, body, headers: dict | None = None, path: str = "/v1/chat/completions",
          **kwargs) -> httpx.Response:
    # json.dumps writes a lone surrogate as its "\ud800" escape, as a client's JSON would
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, **{"timeout": 120, **kwargs},
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def test_the_lockout_counts_the_connection_not_what_it_says_it_is(server):
    url, _service = server
    models = url + "/v1/models"
    assert httpx.get(models, headers=AUTH).status_code == 200  # the key in use
    codes = [httpx.get(models, headers={"Authorization": f"Bearer guess-{i:02}",
                                        "X-Forwarded-For": f"10.0.0.{i}"}).status_code
             for i in range(12)]
    assert codes == [401] * 5 + [429] * 7
    for form in (f"bearer {KEY}", f"Bearer  {KEY}", f"BEARER\t{KEY}"):  # the same key
        assert httpx.get(models, headers={"Authorization": form}).status_code == 200, form
    fresh = {"Authorization": "Bearer never-used-0123", "X-Forwarded-For": "10.9.9.9"}
    assert httpx.get(models, headers=fresh).status_code == 429


def test_no_monitoring_dashboard(server, capfd):
    url, _service = server
    for path in ("/monitoring", "/monitoring/summary", "/monitoring/anything"):
        assert httpx.get(url + path, timeout=30).status_code in (403, 404), path
    assert "monitoring" not in capfd.readouterr().out.lower()


BASE = {**ASK, "accel": "off"}
KEYS = ["model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens",
        "stop", "seed", "stream", "stream_options", "accel", "n", "tools", "response_format"]
VALUES = [None, 5, -1, [1, 2], "x" * 100_000, "a\ud800b", {"a": [1]}, True, 10**400]
RAW = [b"\xff\xfe{}", b'{"messages": [' + b"1" * 5000 + b"]}", b"[" * 100_000,
       b'{"temperature": NaN, "messages": []}', b'{"max_tokens": 1e400}', b"", b"null",
       json.dumps(BASE).encode()[:-3]]
OTHER_POSTS = ["/v1/completions", "/v1/embeddings"]  # read their bodies as chat does


def _said_of_a_failure(r: httpx.Response) -> list[str]:
    """What the server said about a failure: a refusal's body, a stream's error chunks. A
    reply's own text is left out: a random model's words may be "RuntimeError" or ".py"."""
    if r.status_code >= 400:
        return [r.text]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [json.dumps(c["error"], ensure_ascii=False) for c in chunks if "error" in c]


def test_no_body_gets_python_words_or_a_500(server):
    url, _service = server
    answers = [_post(url, body) for body in RAW]
    answers += [_post(url, {**BASE, key: value}) for key in KEYS for value in VALUES]
    answers += [_post(url, body, path=path) for path in OTHER_POSTS for body in RAW]
    answers.append(httpx.get(url + "/v1/models",  # a key of bytes that are not UTF-8
                             headers={"Authorization": b"Bearer \xed\xa0\x80\xff"}))
    assert all(r.status_code < 500 for r in answers), [r.text[:200] for r in answers
                                                       if r.status_code >= 500]
    leaked = [t[:300] for r in answers for t in _said_of_a_failure(r) if PYTHONISMS.search(t)]
    assert not leaked
    errors = [r.json()["error"] for r in answers if r.status_code >= 400]
    assert errors and all(set(e) == {"message", "type", "param", "code"} for e in errors)
    long = [e for e in errors if "\n" in e["message"] or len(e["message"]) >= 600]
    assert not long


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_with_a_lone_surrogate_is_400(server, stream):
    r = _post(server[0], {**BASE, "stop": ["ok", "\ud800"], "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def _medusa_folder(service):
    """The Medusa accelerator's folder for the served model, with weights that load (so a
    description's values, not a missing file, decide whether it builds)."""
    from tests.engine.drafters.test_accelerators import _save

    folder = checkpoint_dir(service.host.lm.fingerprint, "medusa")
    if not (folder / WEIGHTS).is_file():
        _save(service.host.lm)
    return folder


def _info(service, **extra) -> str:
    lm = service.host.lm
    return json.dumps({"kind": "medusa", "version": 1, "fingerprint": lm.fingerprint,
                       "base_model_id": lm.model_id, **extra})


@pytest.mark.parametrize("content", ["[]", "null", "5", '"text"', "{", "[" * 10_000,
                                     "SETTINGS_TEXT", "SETTINGS_WRONG"])
def test_a_broken_accelerator_never_stops_a_reply(server, content):
    url, service = server
    folder = _medusa_folder(service)
    content = {"SETTINGS_TEXT": _info(service, settings="x"),
               "SETTINGS_WRONG": _info(service, settings={"num_heads": "four", "tree": 7})
               }.get(content, content)
    (folder / INFO).write_text(content)
    (folder / METRICS).write_text('{"calibration": []}')
    for accel in ("auto", "medusa", "medusa+lookup", "medusa+datastore", "off"):
        r = _post(url, {**ASK, "accel": accel})
        assert r.status_code == 200, (accel, r.text[:300])
        assert r.json()["quickdraft"]["accel"].split(":")[0] in (accel, "off")


def test_a_fifo_among_the_accelerator_files_never_blocks_a_reply(server):
    url, service = server
    folder = _medusa_folder(service)
    (folder / INFO).write_text(_info(service, settings={}))
    (folder / METRICS).unlink(missing_ok=True)
    os.mkfifo(folder / METRICS)
    try:
        for accel in ("auto", "off", "medusa"):
            r = _post(url, {**ASK, "accel": accel}, timeout=60)
            assert r.status_code == 200, (accel, r.text[:300])
    finally:  # a blocked reader is released, so a failure here does not hang the rest
        try:
            fd = os.open(folder / METRICS, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"{}")
            os.close(fd)
        except OSError:
            pass  # nobody is reading it: nothing blocked
        (folder / METRICS).unlink()


def _slow_chunks(forward, size: int, chunks: list, started: threading.Event):
    """`forward` as a slow machine runs it: each prompt chunk of `size` tokens takes 0.2 s
    more (recorded in `chunks`; `started` is set at the first)."""
    def slow(cache, tokens, start, *args, **kwargs):
        if len(tokens) == size:
            chunks.append(start)
            started.set()
            time.sleep(0.2)
        return forward(cache, tokens, start, *args, **kwargs)
    return slow


def test_a_client_that_hangs_up_during_a_long_prompt_frees_the_model(server, monkeypatch):
    from engine.decode import generate as loop

    url, service = server
    lm = service.host.lm
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 16)
    started, chunks = threading.Event(), []
    monkeypatch.setattr(lm.target, "forward", _slow_chunks(lm.target.forward, 16, chunks,
                                                           started))
    body = json.dumps({**BASE, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "word " * 460}]})
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        assert started.wait(60), "the prompt was never read in chunks"
    deadline = time.monotonic() + 60  # a bound for a broken build, never a speed claim
    while service.host.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not service.host.busy
    assert 1 <= len(chunks) < 10  # of the prompt's ~29 chunks: it stopped at a chunk boundary
    r = _post(url, BASE)  # the next request is served
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_a_plain_reply_reads_no_accelerator_file(server, monkeypatch):
    url, service = server
    _medusa_folder(service)
    read = []

    def refuse(path, *args, **kwargs):
        read.append(path)
        raise AssertionError(f"{path} was read")

    for name in ("read_json", "check_regular"):
        monkeypatch.setattr(f"engine.drafters.accelerators.{name}", refuse)
    r = _post(url, {**ASK, "accel": "off"})
    assert r.status_code == 200 and r.json()["quickdraft"]["accel"] == "off" and read == []

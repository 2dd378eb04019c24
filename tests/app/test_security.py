"""A local server no web page can drive: the app on its default setup (loopback, no login)
attacked as a web page or a local process would. Foreign Host headers, cross-origin
requests, remote code through the page's events, oversized and stalled requests, client
mistakes that must be 4xx, and stored files that must not hide the others.

The server runs in this process on a free loopback port with the bundled model in fp32;
the request guard itself is also driven directly on a tiny ASGI app (clock injected).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from app.ui.launch import LaunchOptions, launch
from engine.config import ModelSpec
from tests.app.test_stored_files import write_bad_store

pytestmark = pytest.mark.slow
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "accel": "off"}
EVIL = "evil.example"


# -- the server ----------------------------------------------------------------------------

def _options(**extra) -> LaunchOptions:
    """LaunchOptions with the fields this version knows (short timeouts for the tests)."""
    known = LaunchOptions.__dataclass_fields__
    return LaunchOptions(**{k: v for k, v in extra.items() if k in known})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("security-data")
    write_bad_store(data)
    try:  # the limits this module asserts, short for the test
        from app.security import Limits
        limits = Limits(header_timeout_s=1.5, body_timeout_s=2.0)
    except ImportError:  # a version without them: the tests show what it does instead
        limits = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUICKDRAFT_DATA_DIR", str(data))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
        mp.delenv("QUICKDRAFT_ORIGINS", raising=False)
        demo, url, service = launch(_options(open_browser=False, model=ModelSpec(quant="fp32"),
                                             limits=limits), block=False)
        try:
            yield url.rstrip("/"), service
        finally:
            demo.close()


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def service(server):
    return server[1]


@pytest.fixture
def generations(service, monkeypatch):
    """Counts the replies the API starts."""
    calls = []
    replies = service.replies
    real = replies.complete
    monkeypatch.setattr(replies, "complete", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def _port(url: str) -> int:
    return urlparse(url).port


# -- 1. DNS rebinding: remote code through the page's load event -----------------------------

def _evil_folder(root: Path) -> tuple[Path, Path]:
    """A model folder whose config runs evil.py when trusted; evil.py leaves a marker."""
    import torch
    from safetensors.torch import save_file

    folder = root / "evil-model"
    folder.mkdir()
    marker = root / "MARKER"
    (folder / "evil.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig",
                                            "AutoModelForCausalLM": "evil.EvilModel"}}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder, marker


def _call(url: str, api: str, data: list, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/gradio_api/call/{api}", json={"data": data},
                      headers=headers or {}, timeout=30)


def _result(url: str, api: str, event_id: str, headers: dict | None = None) -> str:
    r = httpx.get(f"{url}/gradio_api/call/{api}/{event_id}", headers=headers or {}, timeout=300)
    return r.text


def test_rebinding_load_with_remote_code_is_refused_and_runs_nothing(url, service, tmp_path):
    folder, marker = _evil_folder(tmp_path)
    foreign = {"Host": f"{EVIL}:{_port(url)}", "Origin": f"http://{EVIL}:{_port(url)}"}
    r = _call(url, "load", [str(folder), "auto", True], foreign)
    assert r.status_code == 403, r.text
    assert "access-control-allow-origin" not in r.headers
    if r.status_code == 200:  # old behaviour: the result runs the load
        _result(url, "load", r.json()["event_id"], foreign)
    assert not marker.exists()


def test_a_correct_host_cannot_switch_remote_code_on_either(url, service, tmp_path):
    folder, marker = _evil_folder(tmp_path)
    before = service.host.lm.model_id
    for data in ([str(folder), "auto", True], [str(folder), "auto"]):
        r = _call(url, "load", data)
        if r.status_code == 200:
            _result(url, "load", r.json()["event_id"])
        while service.host.loading is not None and service.host.loading.running:
            time.sleep(0.05)
        assert not marker.exists()
    assert service.host.lm.model_id == before  # the bundled model still serves


def test_the_load_event_takes_no_trust_input(url):
    info = httpx.get(f"{url}/gradio_api/info", timeout=30).json()
    params = info["named_endpoints"]["/load"]["parameters"]
    assert [p["parameter_name"] for p in params] == ["source", "quant"]


# -- 2. Host and Origin ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/", "/config", "/gradio_api/info", "/v1/models"])
def test_a_foreign_host_is_refused_everywhere(url, path):
    r = httpx.get(url + path, headers={"Host": f"{EVIL}:{_port(url)}"}, timeout=30)
    assert r.status_code == 403, (path, r.status_code)


def test_a_foreign_host_starts_no_generation(url, generations):
    r = httpx.post(url + "/v1/chat/completions", json=HI, timeout=60,
                   headers={"Host": EVIL})
    assert r.status_code == 403 and generations == []


@pytest.mark.parametrize("host", ["localhost:evil", "127.0.0.1:80@evil", "evil.com#.localhost"])
def test_a_malformed_host_is_refused(url, host):
    assert httpx.get(url + "/config", headers={"Host": host}, timeout=30).status_code == 403


def test_two_origins_are_refused(url, generations):
    r = httpx.post(url + "/v1/chat/completions", json=HI, timeout=60,
                   headers=[("Origin", url), ("Origin", f"http://{EVIL}")])
    assert r.status_code == 400 and generations == []


def test_the_page_cannot_be_framed_by_another_site(url):
    r = httpx.get(url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["x-frame-options"] == "SAMEORIGIN"
    assert r.headers["content-security-policy"] == "frame-ancestors 'self'"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_loopback_names_are_served(url, host):
    r = httpx.get(url + "/config", headers={"Host": f"{host}:{_port(url)}"}, timeout=30)
    assert r.status_code == 200


def test_a_cross_origin_text_plain_post_starts_no_generation(url, generations):
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(HI), timeout=60,
                   headers={"Origin": f"http://{EVIL}", "Content-Type": "text/plain"})
    assert r.status_code == 403 and generations == []


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:1", "null"])
def test_other_local_origins_get_no_echo(url, origin):
    r = httpx.get(url + "/config", headers={"Origin": origin}, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    assert r.status_code == 403
    pre = httpx.options(url + "/gradio_api/queue/join", timeout=30,
                        headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_the_queue_refuses_a_foreign_origin(url):
    r = httpx.post(url + "/gradio_api/queue/join", json={"data": [], "fn_index": 0},
                   headers={"Origin": f"http://{EVIL}"}, timeout=30)
    assert r.status_code == 403


def test_the_page_own_origin_and_no_origin_are_served(url, generations):
    own = httpx.post(url + "/v1/chat/completions", json=HI, timeout=120,
                     headers={"Origin": url})
    assert own.status_code == 200, own.text
    plain = httpx.post(url + "/v1/chat/completions", json=HI, timeout=120)
    assert plain.status_code == 200 and len(generations) == 2


# -- 3/4. Stored files (the rest: tests/app/test_stored_files.py) ---------------------------------

def test_corrupt_conversations_leave_the_others_listed(service, url):
    listed = {c.id: c for c in service.store.list()}
    assert "aaaa" in listed and "dddd" in listed  # the app started and lists them
    assert "bbbb" not in listed and "cccc" not in listed
    md = service.store.export("dddd", "md").read_text()
    assert "42" in md


# -- 5. Limits -------------------------------------------------------------------------------

def _raw(url: str, data: bytes, wait_s: float = 30) -> bytes:
    """Send raw bytes; everything the server answers until it closes (or `wait_s`)."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
    return out


def _head(url: str, body_len: int, extra: str = "") -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urlparse(url).netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n{extra}"
            "Connection: close\r\n\r\n").encode()


def test_an_oversized_body_is_413_before_it_is_sent(url, generations):
    reply = _raw(url, _head(url, 20 * 2**20))  # 20 MB announced, none sent
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert generations == []


def test_a_streamed_body_is_counted(url, generations):
    body = json.dumps({**HI, "messages": [{"role": "user", "content": "x" * 6 * 2**20}]})
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   content=iter([body.encode()[i:i + 2**16]
                                 for i in range(0, len(body), 2**16)]))
    assert r.status_code == 413 and generations == []


def test_a_long_prompt_is_refused_before_tokenizing(url, service, generations, monkeypatch):
    encoded = []
    tokenizer = service.host.lm.tokenizer
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda *a, **k: encoded.append(1) or type(tokenizer).apply_chat_template(
                            tokenizer, *a, **k))
    rss = psutil.Process().memory_info().rss
    body = {**HI, "messages": [{"role": "user", "content": "word " * 700_000}]}  # 3.5 MB
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code in (400, 413) and r.json()["error"]["param"] == "messages"
    assert generations == [] and encoded == []
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 100 * 2**20, f"{grown / 2**20:.0f} MiB kept after one large request"


def test_stalled_connections_are_closed(url):
    where = urlparse(url)
    half_head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\n".encode()
    assert _raw(url, half_head, wait_s=20) == b""  # closed with nothing to say
    stalled_body = _head(url, 1000) + b'{"messages": '
    reply = _raw(url, stalled_body, wait_s=20)
    assert reply.startswith(b"HTTP/1.1 408") or reply == b"", reply[:200]


def test_a_trickled_body_is_closed_at_its_deadline(url, generations):
    """A byte every 0.5 s is never idle long, yet the whole body must arrive within the
    server's deadline (2 s here)."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=20) as sock:
        sock.sendall(_head(url, 1000))
        reply = b""
        for _ in range(40):  # a byte each 0.5 s at most, until the server answers
            if reply:
                break
            try:
                sock.sendall(b" ")
            except OSError:
                break  # closed by the server
            sock.settimeout(0.5)
            try:
                reply = sock.recv(65536) or b"<closed>"
            except TimeoutError:
                continue
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert generations == []


def _files(count: int) -> list:
    return [("files", (f"p{i}.txt", b'{"prompt": "hi"}\n', "text/plain")) for i in range(count)]


def test_uploads_go_to_the_app_folder_and_are_capped(url):
    import os

    folder = Path(os.environ["GRADIO_TEMP_DIR"])  # the fixture's; the app's cache otherwise
    r = httpx.post(url + "/gradio_api/upload", files=_files(1), timeout=30)
    assert r.status_code == 200 and Path(r.json()[0]).is_relative_to(folder)
    before = sorted(folder.rglob("*"))
    r = httpx.post(url + "/gradio_api/upload", files=_files(200), timeout=30)
    assert r.status_code == 413 and sorted(folder.rglob("*")) == before


# -- 6. Client mistakes are 4xx ----------------------------------------------------------------

def _error(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    return r.json()["error"]


@pytest.mark.parametrize("seed", [2**64, -(2**64)])
@pytest.mark.parametrize("stream", [False, True])
def test_a_seed_out_of_range_is_400(url, seed, stream):
    r = httpx.post(url + "/v1/chat/completions", json={**HI, "seed": seed, "stream": stream},
                   timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "seed"


def test_deep_nesting_is_400(url):
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"


UNSUPPORTED = [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    # the bundled model's chat template has no tools
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"n": 9}, "n"),
    ({"logit_bias": {"99999999": 10}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra,param", UNSUPPORTED)
def test_unsupported_features_are_400_naming_them(url, generations, extra, param):
    r = httpx.post(url + "/v1/chat/completions", json={**HI, **extra}, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == param and generations == []


def test_text_response_format_is_accepted(url):
    body = {**HI, "response_format": {"type": "text"}, "tool_choice": "none"}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc",
                                  "/gradio_api/openapi.json"])
def test_no_schema_pages_are_served(url, path):
    assert httpx.get(url + path, timeout=30).status_code == 404


def test_the_api_is_routed_before_the_port_opens(monkeypatch, tmp_path, bundled_tokenizer):
    """The /v1 routes are on the app gradio serves when it starts serving it."""
    import gradio as gr

    from tests.conftest import make_tiny_model

    tiny = make_tiny_model("llama-mha", bundled_tokenizer)
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setattr("app.host.load_model", lambda spec, report=None: tiny)
    seen = {}

    def fake_launch(self, **kwargs):
        from starlette.testclient import TestClient

        app = kwargs.get("_app")
        if app is not None:
            seen["models"] = TestClient(app, base_url="http://127.0.0.1").get("/v1/models")
        raise SystemExit

    monkeypatch.setattr(gr.Blocks, "launch", fake_launch)
    with pytest.raises(SystemExit):
        launch(_options(open_browser=False, model=ModelSpec()), block=False)
    assert seen["models"].status_code == 200
    assert seen["models"].json()["data"][0]["id"] == tiny.model_id

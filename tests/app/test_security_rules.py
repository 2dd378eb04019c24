"""The security rules on their own, without a running server: allowed hosts and origins,
the body cap and login throttling on the request guard (driven on a tiny ASGI app, clock
injected), remote code bound to the start-up model, and one clear message for broken files.
The server-level repros are in test_security.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from app.store import Settings, Store
from engine.config import ModelSpec

# -- the guard on its own: allowed hosts and origins, throttled logins ----------------------

def _tiny_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def echo(request):
        return PlainTextResponse(str(len(await request.body())))

    async def login(request):
        form = await request.form()
        ok = form.get("password") == "right"
        return JSONResponse({"ok": ok}, status_code=200 if ok else 400)

    async def v1(request):
        ok = request.headers.get("authorization") == "Bearer right-key"
        return JSONResponse({}, status_code=200 if ok else 401)

    return Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"]),
                             Route("/gradio_api/upload", echo, methods=["POST"]),
                             Route("/login", login, methods=["POST"]),
                             Route("/v1/models", v1), Route("/v1/open", echo)])


def _guarded(clock=time.monotonic, **policy):
    from starlette.testclient import TestClient

    from app.guard import Guard
    from app.security import make_policy

    guard = Guard(_tiny_app(), make_policy(**policy), clock=clock)
    return TestClient(guard, base_url="http://127.0.0.1:7860")


def test_allowed_hosts_and_origins_are_admitted(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_ORIGINS", "https://app.example.com, http://localhost:3000")
    client = _guarded(host="127.0.0.1", allowed_hosts=("box.lan",),
                      allowed_origins=("http://tool.example:8080",))
    assert client.get("/echo", headers={"Host": "box.lan:7860"}).status_code == 200
    assert client.get("/echo", headers={"Host": "other.lan:7860"}).status_code == 403
    for origin in ("http://tool.example:8080", "https://app.example.com", "http://localhost:3000"):
        r = client.post("/echo", content=b"{}", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "access-control-allow-credentials" not in r.headers
        pre = client.options("/echo", headers={"Origin": origin,
                                               "Access-Control-Request-Method": "POST"})
        assert pre.status_code < 300 and pre.headers["access-control-allow-origin"] == origin
    r = client.post("/echo", content=b"{}", headers={"Origin": "http://localhost:3001"})
    assert r.status_code == 403


def test_an_open_host_admits_addresses_but_not_names():
    client = _guarded(host="0.0.0.0")
    assert client.get("/echo", headers={"Host": "192.168.1.20:7860"}).status_code == 200
    assert client.get("/echo", headers={"Host": "rebound.example:7860"}).status_code == 403


def test_the_body_cap_is_configurable():
    from app.security import Limits

    client = _guarded(host="127.0.0.1", limits=Limits(max_body_bytes=100))
    assert client.post("/echo", content=b"x" * 100).text == "100"
    assert client.post("/echo", content=b"x" * 101).status_code == 413
    streamed = client.post("/echo", content=iter([b"x" * 60, b"x" * 60]))
    assert streamed.status_code == 413


def test_logins_are_throttled_per_client():
    now = [1000.0]
    client = _guarded(clock=lambda: now[0], host="127.0.0.1")
    for _ in range(5):
        assert client.post("/login", data={"password": "wrong"}).status_code == 400
    locked = client.post("/login", data={"password": "right"})
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) > 0
    # API keys are counted apart: wrong logins never lock out a key
    assert client.get("/v1/models", headers={"Authorization": "Bearer right-key"}
                      ).status_code == 200
    now[0] += 3600
    assert client.post("/login", data={"password": "right"}).status_code == 200
    for _ in range(5):
        assert client.get("/v1/models").status_code == 401  # wrong keys count too
    assert client.get("/v1/models").status_code == 429


KEY = {"Authorization": "Bearer right-key"}


@pytest.mark.parametrize("multipart", [False, True])
def test_wrong_credentials_never_lock_out_one_already_accepted(multipart):
    """Every local client is 127.0.0.1: five wrong keys from any local program must not lock
    the user out of the key and login they use. A credential never accepted still waits,
    so guessing stays slowed."""
    client = _guarded(clock=lambda: 1000.0, host="127.0.0.1")

    def login(password: str) -> int:
        form = {"username": "me", "password": password}
        if multipart:  # as the page's FormData
            return client.post("/login", files={k: (None, v) for k, v in form.items()}
                               ).status_code
        return client.post("/login", data=form).status_code

    assert login("right") == 200 and client.get("/v1/models", headers=KEY).status_code == 200
    for _ in range(5):
        assert client.get("/v1/models", headers={"Authorization": "Bearer guess"}
                          ).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer guess2"}
                      ).status_code == 429
    assert login("guess") == 400  # wrong keys do not lock out the login: counted apart
    for _ in range(4):
        assert login("guess") == 400
    assert login("guess2") == 429
    for _ in range(3):  # the key and the login in use pass, and do not end the lockout
        assert client.get("/v1/models", headers=KEY).status_code == 200
        assert login("right") == 200
    assert login("guess3") == 429


def test_an_accepted_api_key_does_not_open_the_login():
    """A value sent as an API key (accepted by a server that needs none) is not trusted as
    the login's user and password."""
    client = _guarded(clock=lambda: 1000.0, host="127.0.0.1")
    assert client.get("/v1/open", headers={"Authorization": "me:guess"}).status_code == 200
    for _ in range(5):
        assert client.post("/login", data={"password": "wrong"}).status_code == 400
    assert client.post("/login", data={"username": "me", "password": "guess"}
                       ).status_code == 429


def test_responses_cannot_be_framed_by_other_sites():
    client = _guarded(host="127.0.0.1", allowed_origins=("http://tool.example:8080",))
    for r in (client.get("/echo"), client.get("/nothing-here"), client.post("/login", data={})):
        assert r.headers["x-frame-options"] == "SAMEORIGIN"
        assert r.headers["content-security-policy"] == (
            "frame-ancestors 'self' http://tool.example:8080")


@pytest.mark.parametrize("host", ["localhost:evil", "127.0.0.1:80@evil", "evil.com#.localhost",
                                  "localhost:", "localhost:99999", "localhost:80:80",
                                  "me@localhost", "[::1", "local host", "localhost/x", "::1"])
def test_a_malformed_host_is_refused(host):
    assert _guarded(host="127.0.0.1").get("/echo", headers={"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:7860", "LOCALHOST.", "[::1]:7860",
                                  "127.0.0.1", "app.localhost:1"])
def test_well_formed_loopback_hosts_are_served(host):
    assert _guarded(host="127.0.0.1").get("/echo", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("name,values", [
    ("origin", ["http://127.0.0.1:7860", "http://evil.example"]),
    ("origin", ["http://127.0.0.1:7860", "http://127.0.0.1:7860"]),
    ("host", ["127.0.0.1:7860", "evil.example"]),
])
def test_a_repeated_host_or_origin_is_refused(name, values):
    client = _guarded(host="127.0.0.1")
    r = client.post("/echo", content=b"{}", headers=[(name, v) for v in values])
    assert r.status_code == 400 and name in r.json()["error"]["message"].lower()


def _http_scope(path: str, headers: list[tuple[bytes, bytes]] = ()) -> dict:
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
            "headers": [(b"host", b"127.0.0.1:7860"), *headers],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 7860)}


def test_a_trickled_body_is_refused_at_its_deadline():
    """A byte every 0.2 s never leaves the body idle, yet the whole body must arrive within
    the deadline (2 s here): then 408."""
    from app.guard import Guard
    from app.security import Limits, make_policy

    guard = Guard(_tiny_app(), make_policy(limits=Limits(body_timeout_s=2.0)))
    sent = []

    async def send(message):
        sent.append(message)

    # the body never ends: only the deadline can answer (wait_for bounds a broken guard)
    asyncio.run(asyncio.wait_for(guard(_http_scope("/echo"), _trickle, send), 15))
    assert sent[0]["status"] == 408


async def _trickle() -> dict:
    """A client sending one byte of a body every 0.2 s, for ever."""
    await asyncio.sleep(0.2)
    return {"type": "http.request", "body": b"x", "more_body": True}


def _multipart(files: int) -> tuple[bytes, dict]:
    parts = b"".join(b'--b0undary\r\nContent-Disposition: form-data; name="files"; '
                     b'filename="p%d.txt"\r\nContent-Type: text/plain\r\n\r\nhello\r\n' % i
                     for i in range(files))
    return parts + b"--b0undary--\r\n", {"content-type": "multipart/form-data; boundary=b0undary"}


def _drive(path: str, chunks: list[bytes], headers: dict) -> tuple[int, bytes]:
    """One request through the guard, its body in `chunks` (as a socket delivers it)."""
    from app.guard import Guard
    from app.security import make_policy

    guard = Guard(_tiny_app(), make_policy())
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    asyncio.run(asyncio.wait_for(guard(_http_scope(path, raw), receive, send), 15))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_bodies_the_guard_reads_first_reach_the_app_whole():
    body, headers = _multipart(2)
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)]
    assert _drive("/gradio_api/upload", chunks, headers) == (200, str(len(body)).encode())
    form = b"username=me&password=right"
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert _drive("/login", [form[:5], form[5:]], headers)[0] == 200


def test_an_upload_takes_a_few_files_at_most():
    client = _guarded(host="127.0.0.1")
    body, headers = _multipart(1)
    assert client.post("/gradio_api/upload", content=body, headers=headers).status_code == 200
    body, headers = _multipart(200)
    r = client.post("/gradio_api/upload", content=body, headers=headers)
    assert r.status_code == 413 and "files" in r.json()["error"]["message"]


@pytest.mark.parametrize("size", ["inf", "nan", "0", "-1"])
def test_a_body_cap_that_is_not_a_positive_finite_number_is_refused(size, capsys):
    from app.cli import main as cli_main

    assert cli_main(["serve", "--no-browser", "--max-body-mb", size]) == 2
    assert "--max-body-mb" in capsys.readouterr().err


def test_uploads_go_to_the_cache_folder_and_old_ones_are_removed(tmp_path, monkeypatch):
    """Each run uploads into a folder of its own; a start removes what runs that are gone
    left (a killed one never cleaned up) and the old files of the ones still running."""
    from app.uploads import MAX_AGE_S, use_upload_folder

    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    uploads = tmp_path / "cache/uploads"
    running = uploads / f"run-{os.getppid()}"  # another app, still running
    old, new = running / "aa/old.txt", running / "bb/new.txt"
    gone = uploads / "run-999999999/cc/big.txt"  # a run killed before it cleaned up
    earlier = uploads / "dd/loose.txt"  # an older version's layout
    for path in (old, new, gone, earlier):
        path.parent.mkdir(parents=True)
        path.write_text("x")
    then = time.time() - MAX_AGE_S - 60
    os.utime(old, (then, then))
    environ = {}
    folder = use_upload_folder(environ)
    assert folder == uploads / f"run-{os.getpid()}"
    assert environ["GRADIO_TEMP_DIR"] == str(folder)
    assert new.exists() and not old.exists() and not old.parent.exists()
    assert not gone.exists() and not gone.parent.parent.exists() and not earlier.exists()
    chosen = {"GRADIO_TEMP_DIR": str(tmp_path / "mine")}  # the user's own choice is kept
    assert use_upload_folder(chosen) == tmp_path / "mine"


# -- 7. Messages for broken files ---------------------------------------------------------------

def test_a_huge_gguf_string_is_reported_as_too_long(tmp_path):
    from engine.errors import QuickdraftError
    from engine.weights.gguf import inspect

    path = tmp_path / "huge.gguf"
    # magic, version 3, 0 tensors, 1 key; the key's name claims 2^40 bytes
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
                     + (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little") + b"k" * 64)
    with pytest.raises(QuickdraftError) as err:
        inspect(path)
    assert "too long" in str(err.value) and "truncated (" not in str(err.value)


def test_an_unknown_gguf_version_is_named(tmp_path):
    from engine.errors import QuickdraftError
    from engine.weights.gguf import inspect

    path = tmp_path / "v99.gguf"
    path.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(16))
    with pytest.raises(QuickdraftError, match="unsupported GGUF version 99"):
        inspect(path)


def test_settings_never_store_a_permission_to_run_code():
    """A model's permission to run its code is never written to settings.json."""
    assert "trust_remote_code" not in Settings.__dataclass_fields__


def test_a_negative_head_count_is_an_invalid_value(bundled_tokenizer):
    from engine.drafters.accelerators import INFO
    from engine.drafters.registry import load_drafter
    from engine.errors import AcceleratorError
    from tests.conftest import make_tiny_model
    from tests.engine.drafters.test_accelerators import _save

    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    _heads, folder = _save(lm, num_heads=4)
    info = json.loads((folder / INFO).read_text())
    info["settings"]["num_heads"] = -1
    (folder / INFO).write_text(json.dumps(info))
    with pytest.raises(AcceleratorError, match="num_heads -1 is not a positive count") as err:
        load_drafter(lm, "medusa")
    assert "expected (" not in str(err.value)


def test_the_page_refuses_a_prompt_that_cannot_fit(tmp_path, bundled_tokenizer, monkeypatch):
    import gradio as gr

    from app.service import Service
    from app.ui.chat_tab import ChatTab
    from tests.conftest import make_tiny_model

    service = Service(Store(tmp_path), make_tiny_model("llama-mha", bundled_tokenizer))
    with gr.Blocks():
        tab = ChatTab(service)
    monkeypatch.setattr(service.replies, "chat", lambda *a: pytest.fail("the reply started"))
    huge = "word " * (4 * service.host.lm.context_len)
    updates = list(tab.send(huge, "", "", 0.7, 1.0, 0, 6, "auto", "off", None))
    assert "characters" in str(updates[-1][tab.readout])


def test_only_the_start_up_model_may_run_its_code(tmp_path, bundled_tokenizer, monkeypatch):
    from app import service as service_module
    from tests.conftest import make_tiny_model

    specs = []
    tiny = make_tiny_model("llama-mha", bundled_tokenizer)
    monkeypatch.setattr("app.host.load_model", lambda spec, report=None:
                        specs.append(spec) or tiny)
    monkeypatch.setattr("app.catalog.fetch_if_needed", lambda spec, report: None)  # no hub
    opened = service_module.Service.open(Store(tmp_path),
                                         ModelSpec("my/model", trust_remote_code=True))
    assert specs[-1].trust_remote_code and opened.host.trusted == "my/model"
    for source, trusted in (("other/model", False), ("my/model", True)):
        job = opened.host.start_load(ModelSpec(source, trust_remote_code=True))
        while job.running:
            time.sleep(0.01)
        assert specs[-1].source == source and specs[-1].trust_remote_code is trusted


# -- secrets and remote code from the command line ----------------------------------------

def test_secrets_come_from_the_environment_or_a_file(monkeypatch, tmp_path):
    from app.cli import main as cli_main

    got = []
    monkeypatch.setattr("app.ui.launch.launch", lambda options, block=True: got.append(options))
    key_file = tmp_path / "key"
    key_file.write_text("file-key-0123456789\n")
    monkeypatch.setenv("QUICKDRAFT_AUTH", "me:secret")
    assert cli_main(["serve", "--host", "0.0.0.0", "--api-key-file", str(key_file)]) == 0
    assert got[-1].auth == ("me", "secret") and got[-1].api_key == "file-key-0123456789"
    monkeypatch.setenv("QUICKDRAFT_API_KEY", "env-key-0123456789")
    assert cli_main(["serve", "--host", "0.0.0.0"]) == 0
    assert got[-1].api_key == "env-key-0123456789"
    auth_file = tmp_path / "auth"
    auth_file.write_text("you:other\n")
    assert cli_main(["serve", "--auth-file", str(auth_file)]) == 0
    assert got[-1].auth == ("you", "other")


def test_trust_remote_code_needs_the_model_it_applies_to(monkeypatch, capsys):
    from app.cli import main as cli_main

    monkeypatch.setattr("app.ui.launch.launch", lambda options, block=True: None)
    assert cli_main(["serve", "--trust-remote-code"]) == 2
    assert "--model" in capsys.readouterr().err

"""What the request guard judges beyond Host and Origin, on a tiny ASGI app: credentials as
the route reads them (any case of "Bearer", any spaces), API keys and logins locked out
apart, an Origin with a user part, a request without an Origin that a browser says another
site sent (Sec-Fetch-Site, Referer), and the upload folder's quota."""

from __future__ import annotations

import time

import pytest

from tests.app.test_security_rules import _guarded, _multipart

KEY = "Bearer right-key"


def _key(client, header: str) -> int:
    return client.get("/v1/models", headers={"Authorization": header}).status_code


@pytest.mark.parametrize("form", ["bearer right-key", "Bearer  right-key", "BEARER\tright-key",
                                  " Bearer right-key "])
def test_a_key_in_another_form_is_the_same_key(form):
    """Accepted once as "Bearer KEY", the key passes a lockout in any form the route takes
    (this tiny route itself takes only the first: that the real one takes them all is
    tests/app/test_server_hostile.py's)."""
    client = _guarded(clock=lambda: 1000.0, host="127.0.0.1")
    assert _key(client, KEY) == 200
    for i in range(5):
        assert _key(client, f"Bearer guess-{i}") == 401
    assert _key(client, "Bearer guess-5") == 429
    assert _key(client, form) != 429


def test_wrong_keys_never_lock_out_a_login_nor_wrong_logins_a_key():
    client = _guarded(clock=lambda: 1000.0, host="127.0.0.1")
    for i in range(6):
        _key(client, f"Bearer guess-{i}")
    assert _key(client, "Bearer guess-6") == 429
    assert client.post("/login", data={"password": "wrong"}).status_code == 400  # not 429
    assert client.post("/login", data={"password": "right"}).status_code == 200
    client = _guarded(clock=lambda: 1000.0, host="127.0.0.1")
    for _ in range(5):
        client.post("/login", data={"password": "wrong"})
    assert client.post("/login", data={"password": "wrong"}).status_code == 429
    assert _key(client, "Bearer guess") == 401  # never-used key: judged, not locked out


@pytest.mark.parametrize("origin", ["http://evil.example@127.0.0.1:7860",
                                    "http://user:pw@127.0.0.1:7860",
                                    "http://127.0.0.1:7860#frag"])
def test_an_origin_with_a_user_part_is_not_the_page_own(origin):
    client = _guarded(host="127.0.0.1")
    r = client.post("/echo", content=b"{}", headers={"Origin": origin})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert client.post("/echo", content=b"{}",
                       headers={"Origin": "http://127.0.0.1:7860"}).status_code == 200


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"},
    {"Referer": "http://evil.example/page"},
    {"Referer": "http://evil.example@127.0.0.1:7860/"},
])
def test_a_post_another_site_sent_without_an_origin_is_refused(headers):
    client = _guarded(host="127.0.0.1")
    r = client.post("/echo", content=b"{}", headers=headers)
    assert r.status_code == 403, headers


@pytest.mark.parametrize("headers", [
    {},  # curl, the openai client, editors
    {"Sec-Fetch-Site": "same-origin", "Referer": "http://127.0.0.1:7860/"},
    {"Sec-Fetch-Site": "none"},  # typed in the address bar
    {"Referer": "http://tool.example:8080/app"},  # an allowed origin's page
])
def test_the_page_its_allowed_origins_and_plain_clients_are_served(headers):
    client = _guarded(host="127.0.0.1", allowed_origins=("http://tool.example:8080",))
    assert client.post("/echo", content=b"{}", headers=headers).status_code == 200


def test_another_site_may_link_to_the_page():
    client = _guarded(host="127.0.0.1")
    link = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
            "Referer": "http://news.example/"}
    assert client.get("/echo", headers=link).status_code == 200
    embedded = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    assert client.get("/echo", headers=embedded).status_code == 403


def test_the_upload_folder_has_a_quota(tmp_path):
    """Each upload fits the body cap; together they may not fill the disk."""
    from starlette.testclient import TestClient

    from app.guard import Guard
    from app.security import Limits, make_policy
    from tests.app.test_security_rules import _tiny_app

    limits = Limits(uploads_bytes=2000, uploads_count=3)
    client = TestClient(Guard(_tiny_app(), make_policy(limits=limits), time.monotonic,
                              uploads=tmp_path), base_url="http://127.0.0.1:7860")
    body, headers = _multipart(1)
    for i in range(3):  # what the app under the guard would store for each upload
        assert client.post("/gradio_api/upload", content=body, headers=headers).status_code \
            == 200
        (tmp_path / f"u{i}").mkdir()
        (tmp_path / f"u{i}/p.txt").write_bytes(b"x" * 100)
    r = client.post("/gradio_api/upload", content=body, headers=headers)
    assert r.status_code == 413 and "upload folder" in r.json()["error"]["message"]
    for i in range(3):
        (tmp_path / f"u{i}/p.txt").unlink()
    (tmp_path / "big.txt").write_bytes(b"x" * 1900)  # one file, near the byte quota
    assert client.post("/gradio_api/upload", content=body, headers=headers).status_code == 413

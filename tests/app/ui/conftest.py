"""One page for the browser tests of this folder: served in this process over a tiny int4
model (its layers are the packed low-bit kind), with one Chromium, shared by every module
that asks for `site` (starting them costs more than most tests)."""

from __future__ import annotations

import pytest

from app.service import Service
from app.store import Store
from engine.config import ModelSpec
from engine.model.loading import wrap_model
from engine.weights import quant
from tests.conftest import make_tiny_model
from tests.page_server import browser, open_page, serve


@pytest.fixture(scope="package")
def tiny_int4(bundled_tokenizer):
    """A tiny Llama quantized to int4, and its parameter count before quantizing."""
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    params = sum(p.numel() for p in lm.model.parameters())
    model = quant.quantize_model(lm.model, "int4", wide_rows=4)  # bf16 copies kept
    return wrap_model(model, lm.tokenizer, ModelSpec(source="tiny", quant="int4"), "tiny",
                      "int4", model_fingerprint=lm.fingerprint), params


@pytest.fixture(scope="package")
def site(tiny_int4, tmp_path_factory):
    """(service, url, browser): one server and one Chromium for the whole folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        store = Store(tmp_path_factory.mktemp("page-data"))
        # the tiny model's window is 512; its name is no folder (the Models tab sizes no other)
        store.remember(max_new_tokens=16, temperature=0.0, model="tiny")
        service = Service(store, tiny_int4[0])
        with serve(service) as url, browser() as chrome:
            yield service, url, chrome


@pytest.fixture
def page(site):
    """A fresh tab on the page, in a new conversation."""
    _service, url, chrome = site
    page = open_page(chrome, url)
    page.click("#qd-new")
    yield page
    page.close()

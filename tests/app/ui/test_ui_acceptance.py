"""The chat settings offer Medusa's typical acceptance, labelled as not lossless, and a reply
asked with it samples with SamplingParams(acceptance="typical")."""

from __future__ import annotations

import gradio as gr
import pytest

from app.service import Service
from app.store import Store
from app.ui.chat_tab import ChatTab
from tests.conftest import make_tiny_model


@pytest.fixture
def tab(tmp_path, bundled_tokenizer):
    service = Service(Store(tmp_path / "data"), make_tiny_model("llama-mha", bundled_tokenizer))
    with gr.Blocks():
        return ChatTab(service)


def test_typical_acceptance_is_offered_beside_the_lossless_default(tab):
    assert ("Typical (faster, not lossless)", "typical") in tab.acceptance.choices
    assert tab.acceptance.value == "auto"  # lossless unless the user opts in
    assert tab.acceptance in tab.sampling  # sent with every reply and regeneration


@pytest.mark.parametrize("choice", ["auto", "typical"])
def test_a_reply_samples_with_the_chosen_acceptance(tab, monkeypatch, choice):
    asked = []
    real_chat = tab.service.replies.chat
    monkeypatch.setattr(tab.service.replies, "chat", lambda ask, message: asked.append(ask) or
                        real_chat(ask, message))
    updates = list(tab.send("Tell me about rain", "", "", 0.7, 1.0, 0, 6, choice, "off", None))
    assert asked[0].params.acceptance == choice and asked[0].params.temperature == 0.7
    last = updates[-1]
    assert tab.conv_list in last and "qd-error" not in last[tab.readout]  # streamed to its end
    saved = tab.service.store.get(asked[0].conv_id).messages
    assert last[tab.chatbot][-1]["content"] == saved[-1]["content"]  # the saved reply shown
    assert 0 < saved[-1]["stats"]["tokens"] <= 6 and asked[0].params.max_new_tokens == 6

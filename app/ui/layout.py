"""The page: a header, the Chat, Models and Train tabs, and the events that cross tabs."""

from __future__ import annotations

import gradio as gr

from app.service import Service
from app.ui.chat_tab import ACCEL, GENERATE, INSTANT, ChatTab
from app.ui.models import ModelsTab
from app.ui.train_tab import TrainTab
from app.uploads import MAX_AGE_S, SWEEP_S

HEADER = ("## Quickdraft\nChat with a local model; switch on a trained accelerator to decode "
          "several tokens per step.")


def build_app(service: Service) -> gr.Blocks:
    """The whole UI for `service` (not launched)."""
    # Gradio removes its temporary files (uploads, exports) once a day old, and all at exit
    with gr.Blocks(title="Quickdraft", analytics_enabled=False,
                   delete_cache=(SWEEP_S, MAX_AGE_S)) as demo:
        gr.Markdown(HEADER, elem_id="qd-intro")
        with gr.Tabs(selected="chat", elem_id="qd-tabs") as tabs:
            with gr.Tab("Chat", id="chat"):
                chat = ChatTab(service)
            with gr.Tab("Models", id="models"):
                models = ModelsTab(service)
            with gr.Tab("Train accelerator", id="train", elem_id="qd-train-tab"):
                train = TrainTab(service)
        chat.wire()
        loaded = models.wire()
        train.wire()
        _wire_across(chat, models, train, tabs, loaded)
        restored = demo.load(chat.restore, None,
                             chat.view_outputs + chat.sampling + chat.accel_outputs, **INSTANT)
        restored.then(chat.check_accel, [chat.accel], chat.accel_outputs, **ACCEL)
        demo.load(models.refresh, None, [models.current, models.source, models.estimate,
                                         models.status], **INSTANT)
        demo.load(train.refresh, None, [train.target, *train.tick_outputs], **INSTANT)
    return demo


def _wire_across(chat: ChatTab, models: ModelsTab, train: TrainTab, tabs: gr.Tabs,
                 loaded: gr.events.Dependency) -> None:
    # "Train accelerator" next to the selector opens the Train tab on that method.
    chat.train_btn.click(lambda pending: (gr.Tabs(selected="train"), pending or gr.skip()),
                         [chat.pending], [tabs, train.method], **INSTANT)
    # A new model: re-check the acceleration (its accelerators are its own) and retarget.
    loaded.then(chat.select_accel, [chat.active, chat.active], chat.accel_outputs, **ACCEL)
    loaded.then(lambda: gr.Timer(active=True), None, [chat.activity], **INSTANT)  # its build
    loaded.then(train.refresh, None, [train.target, *train.tick_outputs], **INSTANT)

    # A finished training run: switch its accelerator on and show what it does.
    def select(finished: str, active: str):
        if not finished:
            return {chat.accel: gr.skip()}
        return chat.select_accel(finished.split("@")[0], active)

    def compare(finished: str, conv_id: str, active: str, max_new: int, request: gr.Request):
        if not finished or active != finished.split("@")[0]:
            yield gr.skip()
            return
        yield from chat.compare(conv_id, active, max_new, request)

    switched = train.finished.change(select, [train.finished, chat.active], chat.accel_outputs,
                                     **ACCEL)
    switched.then(compare, [train.finished, chat.conv_id, chat.active, chat.max_new],
                  [chat.compare_out], **GENERATE)

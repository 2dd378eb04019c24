"""The page: a header, the Chat, Models and Train tabs, and the events that cross tabs."""

from __future__ import annotations

import gradio as gr

from app.service import Service
from app.ui.chat_tab import ACCEL, GENERATE, INSTANT, ChatTab
from app.ui.guarded import GuardedBlocks
from app.ui.models import ModelsTab
from app.ui.train_tab import TrainTab
from app.uploads import MAX_AGE_S, SWEEP_S

HEADER = ("## Quickdraft\nChat with a local model; switch on a trained accelerator to decode "
          "several tokens per step.")


def build_app(service: Service) -> gr.Blocks:
    """The whole UI for `service` (not launched). Every event answers a mistake or a
    failure in one line (app/ui/guarded.py)."""
    # Gradio removes its temporary files (uploads, exports) once a day old, and all at exit
    with GuardedBlocks(title="Quickdraft", analytics_enabled=False,
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
        # The page's own loading shows no "processing" overlay over the controls: the chat
        # is usable at once, and the Acceleration panel says it is checking
        quiet = dict(show_progress="hidden")
        restored = demo.load(chat.restore, None,
                             chat.view_outputs + chat.sampling + chat.accel_outputs, **INSTANT,
                             **quiet)
        restored.then(chat.check_accel, [chat.accel], chat.accel_outputs, **ACCEL, **quiet)
        demo.load(models.refresh, None, [models.current, models.source, models.estimate,
                                         models.status], **INSTANT, **quiet)
        demo.load(train.refresh, None, [train.target, *train.tick_outputs], **INSTANT, **quiet)
    return demo


def _wire_across(chat: ChatTab, models: ModelsTab, train: TrainTab, tabs: gr.Tabs,
                 loaded: gr.events.Dependency) -> None:
    # "Train accelerator" next to the selector opens the Train tab on that method.
    chat.train_btn.click(lambda pending: (gr.Tabs(selected="train"), pending or gr.skip()),
                         [chat.pending], [tabs, train.method], **INSTANT)
    # A new model: re-check the acceleration (its accelerators are its own) and retarget.
    loaded.then(chat.select_accel, [chat.active, chat.active], chat.accel_outputs, **ACCEL,
                show_progress="hidden")
    loaded.then(lambda: gr.Timer(active=True), None, [chat.activity], **INSTANT,
                show_progress="hidden")  # its build
    loaded.then(train.refresh, None, [train.target, *train.tick_outputs], **INSTANT,
                show_progress="hidden")
    # The first start's model, loaded behind a page already open: the other tabs catch up.
    ready = chat.model_ready.change(models.refresh, None, [models.current, models.source,
                                                            models.estimate, models.status],
                                    **INSTANT, show_progress="hidden")
    ready.then(train.refresh, None, [train.target, *train.tick_outputs], **INSTANT,
               show_progress="hidden")

    # A finished training run: switch its accelerator on and show what it does.
    def select(finished: str, active: str):
        if not finished:
            return {chat.accel: gr.skip()}
        return chat.select_accel(finished.split("@")[0], active)

    def compare(finished: str, conv_id: str, active: str, max_new: int, request: gr.Request):
        if not finished or active != finished.split("@")[0]:
            yield {chat.compare_out: gr.skip()}
            return
        yield from chat.compare(conv_id, active, max_new, request)

    # (a State's change also fires when the page loads: no overlay for that either)
    switched = train.finished.change(select, [train.finished, chat.active], chat.accel_outputs,
                                     show_progress="hidden", **ACCEL)
    switched.then(compare, [train.finished, chat.conv_id, chat.active, chat.max_new],
                  [chat.compare_out, chat.accel_status], show_progress="hidden", **GENERATE)

"""Chat tab: a header naming the model, its quantization and the acceleration; the
conversations; the streaming chat with its live readout; the acceleration selector and the
sampling settings (saved as they change). Lays out components and wires them: replies are
handled in app/ui/chat_replies.py, conversations in app/ui/chat_conversations.py."""

from __future__ import annotations

import html

import gradio as gr

from app.drafting import accel_label
from app.host import model_name, quant_verdict
from app.service import Service
from app.settings_rules import PAGE_ACCEPTANCE, page_choice, page_number, page_text
from app.ui.chat_conversations import ConversationEvents
from app.ui.chat_replies import ReplyEvents
from engine.drafters.registry import ACCEL_CHOICES
from engine.errors import QuickdraftError

# Generation-type events share one slot: one reply (or Compare) at a time, the rest wait in
# Gradio's queue, which shows each waiting browser its position.
GENERATE = dict(concurrency_id="generate", concurrency_limit=1)
# Cheap events never wait behind a reply (Stop above all).
INSTANT = dict(concurrency_limit=None)
# Acceleration checks (they may build drafters: seconds after a model load) run one at a
# time and in order, so a user's choice always lands after the page's own check at load.
ACCEL = dict(concurrency_id="accel", concurrency_limit=1)
# How a drafter's tokens are accepted when sampling (SamplingParams.acceptance). "auto" is
# the lossless rule (greedy at temperature 0); Medusa's typical acceptance is faster but
# changes the output distribution, and says so.
ACCEPTANCE = [("Lossless (exact sampling)", "auto"), ("Typical (faster, not lossless)", "typical")]
# Send empties the message box at once (the message is queued if a reply is running), so
# what the user types next is never overwritten when the queued message goes out.
EMPTY_BOX = """(...args) => {
    const box = document.querySelector('#qd-msg textarea');
    if (box) { box.value = ''; box.dispatchEvent(new Event('input', {bubbles: true})); }
    return args;
}"""
FIGURES = """**tok/s**: tokens of the reply per second, from sending it to its last token.
**TTFT**: time to first token: reading the prompt and choosing the first token.
**tokens/step**: tokens each full-model step added: the draft tokens the model accepted plus
its own (plain decoding adds 1). **steps**: which source drafted the reply's steps: copies
from this conversation, the datastore of the model's earlier replies, a trained drafter
(Medusa, Kangaroo), or none (plain steps). **Tokens added per step**: how many steps added
1, 2, 3… tokens. **CTAR(w)**: the share of steps whose first w drafted tokens were all
accepted. **Compare** replays the chat's last prompt greedily with acceleration Off, then
on, and says whether the texts match and how much of the gain repeated earlier text."""
SETTINGS = {"temperature": False, "top_p": False, "top_k": True, "max_new_tokens": True}


class ChatTab(ConversationEvents, ReplyEvents):
    """The components of the chat tab and their event handlers."""

    def __init__(self, service: Service):
        self.service = service
        s = service.store.load_settings()
        self.conv_id = gr.State("")  # this browser's open conversation
        self.active = gr.State("off")  # the acceleration replies use
        self.pending = gr.State("")  # an untrained method the user picked: Train offers it
        self.undo_id = gr.State("")  # the conversation Undo brings back
        self.header = gr.Markdown(elem_id="qd-chat-header", elem_classes="qd-header")
        # While the start-up model loads (the page is served first) or its compiled step is
        # built, the header says what is going on, once a second; the timer stops after.
        self.activity = gr.Timer(1.0, active=True)
        self.model_ready = gr.State(False)  # set once a model is loaded: the accel check runs
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=210, elem_id="qd-sidebar"):
                self._sidebar()
            with gr.Column(scale=4, min_width=330, elem_id="qd-chat-col"):
                self._chat_column()
            with gr.Column(scale=2, min_width=250, elem_id="qd-settings-col"):
                self._settings(s)
        self.sampling = [self.temperature, self.top_p, self.top_k, self.max_new, self.acceptance]

    def _sidebar(self) -> None:
        self.new_btn = gr.Button("New chat", size="sm", elem_id="qd-new")
        self.search_box = gr.Textbox(show_label=False, placeholder="Search conversations",
                                     elem_id="qd-search")
        with gr.Row(visible=False, elem_id="qd-undo-row") as self.undo_row:
            self.undo_note = gr.HTML()
            self.undo_btn = gr.Button("Undo", size="sm", scale=0, min_width=70,
                                      elem_id="qd-undo")
        self.conv_list = gr.Radio([], label="Conversations", elem_id="qd-conversations")
        with gr.Accordion("Rename · delete · export", open=False):
            self.title_box = gr.Textbox(label="Name", elem_id="qd-title")
            with gr.Row():
                self.rename_btn = gr.Button("Rename", size="sm")
                self.delete_btn = gr.Button("Delete", size="sm", variant="stop",
                                            elem_id="qd-delete")
            with gr.Row():
                self.export_md = gr.Button("Markdown", size="sm")
                self.export_json = gr.Button("JSON", size="sm")
            self.export_file = gr.DownloadButton(visible=False, size="sm",
                                                 elem_id="qd-export-file")

    def _chat_column(self) -> None:
        self.chatbot = gr.Chatbot(height=400, show_label=False, elem_id="qd-chatbot",
                                  buttons=["copy", "copy_all"], feedback_options=None)
        self.readout = gr.HTML(elem_id="qd-readout")
        with gr.Row(equal_height=True, elem_id="qd-msg-row"):
            self.msg = gr.Textbox(show_label=False, placeholder="Message the model…", scale=6,
                                  min_width=200, lines=1, max_lines=8, autofocus=True,
                                  elem_id="qd-msg")
            self.send_btn = gr.Button("Send", variant="primary", scale=1, min_width=70,
                                      elem_id="qd-send")
            self.stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=70,
                                      elem_id="qd-stop")
        self.queued = gr.HTML(elem_id="qd-queued", elem_classes="qd-queued")
        with gr.Row():
            self.regen_btn = gr.Button("Regenerate", size="sm", elem_id="qd-regen")
            self.compare_btn = gr.Button("Compare: Off vs accelerated", size="sm",
                                         elem_id="qd-compare")
        self.compare_out = gr.HTML(elem_id="qd-compare-out")
        with gr.Row(visible=False) as self.plots:  # after an accelerated reply
            self.hist_plot = gr.BarPlot(x="tokens per step", y="steps", y_lim=[0, None],
                                        height=170, title="This reply: tokens added per step",
                                        elem_id="qd-hist-plot")
            self.ctar_plot = gr.BarPlot(x="window", y="CTAR", y_lim=[0, 1], height=170,
                                        title="This reply: CTAR(w)", elem_id="qd-ctar-plot")
        with gr.Accordion("What these figures mean", open=False):
            gr.Markdown(FIGURES, elem_id="qd-figures-help")

    def _settings(self, s) -> None:
        self.accel = gr.Radio([(accel_label(m), m) for m in ACCEL_CHOICES], value="auto",
                              label="Acceleration", elem_id="qd-accel")
        self.accel_status = gr.Markdown(elem_id="qd-accel-status")
        self.train_btn = gr.Button("Train accelerator", visible=False, size="sm",
                                   variant="primary", elem_id="qd-train-open")
        self.system = gr.Textbox(s.system, label="System prompt", lines=2,
                                 placeholder="(the model's default)", elem_id="qd-system")
        with gr.Accordion("Sampling", open=True):
            self.temperature = gr.Slider(0, 2, s.temperature, step=0.05,
                                         label="Temperature (0 = greedy)",
                                         elem_id="qd-temperature")
            self.top_p = gr.Slider(0.05, 1, s.top_p, step=0.01, label="Top-p", elem_id="qd-top-p")
            self.top_k = gr.Slider(0, 200, s.top_k, step=1, label="Top-k (0 = off)",
                                   elem_id="qd-top-k")
            self.max_new = gr.Slider(1, 4096, s.max_new_tokens, step=1, label="Max new tokens",
                                     elem_id="qd-max-new")
            self.acceptance = gr.Radio(ACCEPTANCE, value=s.acceptance,
                                       label="Acceptance (temperature > 0, accelerated)",
                                       elem_id="qd-acceptance")

    # -- wiring -------------------------------------------------------------------
    def wire(self) -> None:
        reply_out = [self.chatbot, self.readout, self.plots, self.hist_plot, self.ctar_plot,
                     self.conv_list, self.conv_id, self.queued, self.undo_row, self.title_box]
        send_in = [self.msg, self.conv_id, self.system, *self.sampling, self.active]
        # The queue position and progress show on the chat itself, not on every output; a
        # message sent while a reply runs is queued behind it ("multiple"), not dropped.
        shown = dict(show_progress_on=[self.chatbot], trigger_mode="multiple", **GENERATE)
        sent = [self.msg.submit, self.send_btn.click]
        # the note first: the page dispatches a trigger's events in order, the next only once
        # the one before has been taken up, and a queued Send waits
        gr.on(sent, self.note_queued, None, [self.queued], show_progress="hidden", **INSTANT)
        gr.on(sent, self.send, send_in, reply_out, js=EMPTY_BOX, **shown)
        self.regen_btn.click(self.regenerate, send_in[1:], reply_out, **shown)  # no message
        self.stop_btn.click(self.stop, None, None, **INSTANT)
        self.compare_btn.click(self.compare, [self.conv_id, self.active, self.max_new],
                               [self.compare_out], **GENERATE)
        self.accel.input(self.select_accel, [self.accel, self.active], self.accel_outputs,
                         **ACCEL)
        self._wire_settings()
        self._wire_conversations()
        self.activity.tick(self.show_activity, [self.active, self.model_ready],
                           [self.header, self.activity, self.model_ready],
                           show_progress="hidden", **INSTANT)
        self.model_ready.change(self.check_accel, [self.accel], self.accel_outputs, **ACCEL)

    def _wire_settings(self) -> None:
        """Each setting is saved as it changes (a reload keeps it without sending)."""
        for key, component in zip(SETTINGS, self.sampling, strict=False):
            component.input(self._saver(key), [component], None, **INSTANT)
        self.acceptance.input(self.save_acceptance, [self.acceptance], None, **INSTANT)
        self.system.input(self.save_system, [self.conv_id, self.system], None,
                          trigger_mode="always_last", **INSTANT)

    def _wire_conversations(self) -> None:
        view = self.view_outputs
        self.conv_list.input(self.open_conv, [self.conv_list, self.conv_id], view, **INSTANT)
        self.new_btn.click(self.new_conv, [self.conv_id, self.system], view, **INSTANT)
        self.search_box.input(self.search, [self.search_box, self.conv_id], [self.conv_list],
                              trigger_mode="always_last", **INSTANT)
        self.rename_btn.click(self.rename, [self.conv_id, self.title_box], [self.conv_list],
                              **INSTANT)
        self.delete_btn.click(self.delete, [self.conv_id], view, **INSTANT)
        self.chatbot.clear(self.clear, [self.conv_id], view, **INSTANT)
        self.undo_btn.click(self.undo, [self.undo_id], view, **INSTANT)
        self.export_md.click(lambda c: self.export(c, "md"), [self.conv_id], [self.export_file],
                             **INSTANT)
        self.export_json.click(lambda c: self.export(c, "json"), [self.conv_id],
                               [self.export_file], **INSTANT)

    @property
    def accel_outputs(self) -> list:
        return [self.accel, self.active, self.accel_status, self.train_btn, self.pending,
                self.header]

    # -- settings -----------------------------------------------------------------
    def _saver(self, key: str):
        def save(value) -> None:
            try:
                self.service.store.remember(**{key: page_number(key, value, SETTINGS[key])})
            except QuickdraftError as exc:
                gr.Warning(str(exc))
        return save

    def save_acceptance(self, value) -> None:
        try:
            self.service.store.remember(acceptance=page_choice("acceptance", value,
                                                                PAGE_ACCEPTANCE))
        except QuickdraftError as exc:
            gr.Warning(str(exc))

    def save_system(self, conv_id, system) -> None:
        """The open conversation's system prompt, and the one new conversations start with."""
        try:
            system = page_text("the system prompt", system)
            if conv_id:
                self.service.store.set_system(conv_id, system)
            self.service.store.remember(system=system)
        except QuickdraftError as exc:
            gr.Warning(str(exc))

    # -- acceleration -------------------------------------------------------------
    def select_accel(self, method, active):
        """Use `method` if it is ready; otherwise keep the current one and offer training."""
        try:
            method = page_choice("the acceleration", method, ACCEL_CHOICES)
            status = self.service.accels.status(method)
        except QuickdraftError as exc:
            return {self.accel: active, self.accel_status: f"⚠ {exc}"}
        if status.ready:
            self.service.store.remember(accel=method)
            return {self.accel: method, self.active: method, self.accel_status: status.message,
                    self.train_btn: gr.Button(visible=False), self.pending: "",
                    self.header: self.header_text(method)}
        return {self.accel: active, self.accel_status: f"⚠ {status.message}",
                self.train_btn: gr.Button(f"Train {accel_label(method)} accelerator",
                                          visible=status.train_needed),
                self.pending: method if status.train_needed else "",
                self.header: self.header_text(active)}

    def check_accel(self, method):
        """After the page restored itself: whether the saved acceleration is ready for this
        model (Auto, without forgetting the saved choice, when it is not)."""
        try:
            status = self.service.accels.status(method)
        except QuickdraftError as exc:
            return {self.accel_status: f"⚠ {exc}"}
        if status.ready:
            return {self.accel_status: status.message, self.header: self.header_text(method),
                    self.train_btn: gr.Button(visible=False)}
        auto = self.service.accels.status("auto")
        return {self.accel: "auto", self.active: "auto",
                self.accel_status: f"⚠ {status.message} Using Auto.\n\n{auto.message}",
                self.header: self.header_text("auto")}

    def header_text(self, method: str) -> str:
        """Model · quantization and its verdict · acceleration, for the top of the tab, and
        below it what is being prepared (the start-up load's stage, the compiled step's
        build) while it is."""
        host = self.service.host
        lm, doing = host.current, host.activity()
        status = f'\n\n<span id="qd-activity">⏳ {html.escape(doing)}</span>' if doing else ""
        if lm is None:
            if host.loading is not None and host.loading.running:
                return f"**Loading {html.escape(host.loading.title)}…** (the page works "\
                       f"meanwhile; replies wait for it){status}"
            return "**No model loaded**: load one on the Models tab."
        return (f"**{model_name(lm)}** · {quant_verdict(lm)} · "
                f"Acceleration: **{accel_label(method)}**{status}")

    def show_activity(self, method: str, ready: bool) -> dict:
        """A tick of the header's timer: the header again, whether a model is there now, and
        the timer stopped once nothing is being prepared."""
        now = self.service.host.current is not None
        out = {self.header: self.header_text(method), self.model_ready: now or ready}
        if now and not self.service.host.activity():
            out[self.activity] = gr.Timer(active=False)
        return out

    # -- page load ----------------------------------------------------------------
    def restore(self) -> dict:
        """On page load: the last conversation, the settings and the saved acceleration.
        Nothing here builds a drafter (check_accel follows, queued with the user's own
        acceleration choices): a slow check must never land after what the user did."""
        s = self.service.store.load_settings()
        convs = self.service.store.list()
        last = next((c for c in convs if c.id == s.last_conversation), None)
        conv = last or (convs[0] if convs else self.service.store.new(system=s.system))
        out = self.show(conv)
        out.update({self.temperature: s.temperature, self.top_p: s.top_p, self.top_k: s.top_k,
                    self.max_new: s.max_new_tokens, self.acceptance: s.acceptance,
                    self.accel: s.accel, self.active: s.accel, self.header: self.header_text(
                        s.accel), self.accel_status: "Checking the accelerators…"})
        return out

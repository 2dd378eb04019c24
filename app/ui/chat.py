"""Chat tab: conversations, the streaming chat with its live readout, the acceleration
selector and Compare. Lays out components and wires them to the service."""

from __future__ import annotations

import gradio as gr

from app.drafting import accel_label
from app.replies import ReplyRequest
from app.security import prompt_too_long
from app.service import Service
from app.conversation import Conversation
from app.ui import readout
from engine.config import SamplingParams
from engine.drafters.registry import ACCEL_CHOICES
from engine.errors import QuickdraftError

# Generation-type events share one slot: one reply (or Compare) at a time, the rest wait in
# Gradio's queue, which shows each waiting browser its position.
GENERATE = dict(concurrency_id="generate", concurrency_limit=1)
# Cheap events never wait behind a reply (Stop above all).
INSTANT = dict(concurrency_limit=None)
# How a drafter's tokens are accepted when sampling (SamplingParams.acceptance). "auto" is
# the lossless rule (greedy at temperature 0); Medusa's typical acceptance is faster but
# changes the output distribution, and says so.
ACCEPTANCE = [("Lossless (exact sampling)", "auto"), ("Typical (faster, not lossless)", "typical")]


class ChatTab:
    """The components of the chat tab and their event handlers."""

    def __init__(self, service: Service):
        self.service = service
        s = service.store.load_settings()
        self.conv_id = gr.State("")  # this browser's open conversation
        self.active = gr.State("off")  # the acceleration replies use
        self.pending = gr.State("")  # an untrained method the user picked: Train offers it
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=210):
                self._sidebar()
            with gr.Column(scale=4, min_width=420):
                self._chat_column()
            with gr.Column(scale=2, min_width=250):
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
                    self.top_p = gr.Slider(0.05, 1, s.top_p, step=0.01, label="Top-p")
                    self.top_k = gr.Slider(0, 200, s.top_k, step=1, label="Top-k (0 = off)")
                    self.max_new = gr.Slider(1, 4096, s.max_new_tokens, step=1,
                                             label="Max new tokens", elem_id="qd-max-new")
                    self.acceptance = gr.Radio(ACCEPTANCE, value="auto",
                                               label="Acceptance (temperature > 0, accelerated)",
                                               elem_id="qd-acceptance")
        self.sampling = [self.temperature, self.top_p, self.top_k, self.max_new, self.acceptance]

    def _sidebar(self) -> None:
        self.new_btn = gr.Button("New chat", size="sm", elem_id="qd-new")
        self.conv_list = gr.Radio([], label="Conversations", elem_id="qd-conversations")
        with gr.Accordion("Rename · delete · export", open=False):
            self.title_box = gr.Textbox(label="Name", elem_id="qd-title")
            with gr.Row():
                self.rename_btn = gr.Button("Rename", size="sm")
                self.delete_btn = gr.Button("Delete", size="sm", variant="stop")
            with gr.Row():
                self.export_md = gr.Button("Markdown", size="sm")
                self.export_json = gr.Button("JSON", size="sm")
            self.export_file = gr.File(label="Export", visible=False, interactive=False)

    def _chat_column(self) -> None:
        self.chatbot = gr.Chatbot(height=400, label="Chat", elem_id="qd-chatbot",
                                  buttons=["copy"], feedback_options=None)
        self.readout = gr.HTML(elem_id="qd-readout")
        with gr.Row(equal_height=True):
            self.msg = gr.Textbox(show_label=False, placeholder="Message the model…", scale=6,
                                  lines=1, max_lines=8, autofocus=True, elem_id="qd-msg")
            self.send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="qd-send")
            self.stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="qd-stop")
        with gr.Row():
            self.regen_btn = gr.Button("Regenerate", size="sm", elem_id="qd-regen")
            self.compare_btn = gr.Button("Compare: Off vs accelerated", size="sm",
                                         elem_id="qd-compare")
        self.compare_out = gr.HTML(elem_id="qd-compare-out")
        with gr.Row(visible=False) as self.plots:  # after an accelerated reply
            self.hist_plot = gr.BarPlot(x="tokens per step", y="steps", y_lim=[0, None],
                                        height=170, title="Tokens added per step",
                                        elem_id="qd-hist-plot")
            self.ctar_plot = gr.BarPlot(x="window", y="CTAR", y_lim=[0, 1], height=170,
                                        title="CTAR(w)", elem_id="qd-ctar-plot")

    # -- wiring -------------------------------------------------------------------
    def wire(self) -> None:
        reply_out = [self.chatbot, self.msg, self.readout, self.plots, self.hist_plot,
                     self.ctar_plot, self.conv_list, self.conv_id]
        send_in = [self.msg, self.conv_id, self.system, *self.sampling, self.active]
        # The queue position and progress show on the chat itself, not on every output.
        shown = dict(show_progress_on=[self.chatbot], **GENERATE)
        gr.on([self.msg.submit, self.send_btn.click], self.send, send_in, reply_out, **shown)
        self.regen_btn.click(self.regenerate, send_in[1:], reply_out, **shown)  # no message
        self.stop_btn.click(self.stop, None, None, **INSTANT)
        self.compare_btn.click(self.compare, [self.conv_id, self.active, self.max_new],
                               [self.compare_out], **GENERATE)
        self.accel.input(self.select_accel, [self.accel, self.active], self.accel_outputs,
                         **INSTANT)
        view = self.view_outputs
        self.conv_list.input(self.open_conv, [self.conv_list], view, **INSTANT)
        self.new_btn.click(self.new_conv, [self.conv_id, self.system], view, **INSTANT)
        self.rename_btn.click(self.rename, [self.conv_id, self.title_box], [self.conv_list],
                              **INSTANT)
        self.delete_btn.click(self.delete, [self.conv_id], view, **INSTANT)
        self.export_md.click(lambda c: self.export(c, "md"), [self.conv_id], [self.export_file])
        self.export_json.click(lambda c: self.export(c, "json"), [self.conv_id], [self.export_file])

    @property
    def accel_outputs(self) -> list:
        return [self.accel, self.active, self.accel_status, self.train_btn, self.pending]

    @property
    def view_outputs(self) -> list:
        return [self.conv_id, self.chatbot, self.conv_list, self.title_box, self.system,
                self.readout, self.plots, self.compare_out, self.export_file]

    # -- replies ------------------------------------------------------------------
    def send(self, message, conv_id, system, temperature, top_p, top_k, max_new, acceptance,
             method, request: gr.Request):
        try:
            params = _params(temperature, top_p, top_k, max_new, acceptance)
            chars = len(message or "") + len(system or "")
            if (why := prompt_too_long(chars, self.service.host.lm.context_len)) is not None:
                raise QuickdraftError(why)  # before the tokenizer reads megabytes of it
            conv = self._conversation(conv_id)
            ask = ReplyRequest(conv.id, params, method, system, _session(request))
            stream = self.service.replies.chat(ask, message)
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc))}
            return
        self.service.store.remember(system=system, temperature=params.temperature,
                                    top_p=params.top_p, top_k=params.top_k,
                                    max_new_tokens=params.max_new_tokens, last_conversation=conv.id)
        shown = conv.turns() + [{"role": "user", "content": message}]
        yield {self.chatbot: shown, self.msg: "", self.conv_id: conv.id,
               self.plots: gr.Row(visible=False), self.readout: readout.live_readout_waiting()}
        yield from self._stream(stream, conv.id)

    def regenerate(self, conv_id, system, temperature, top_p, top_k, max_new, acceptance,
                   method, request: gr.Request):
        try:
            params = _params(temperature, top_p, top_k, max_new, acceptance)
            conv = self._conversation(conv_id)
            ask = ReplyRequest(conv.id, params, method, system, _session(request))
            stream = self.service.replies.regenerate(ask)
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc))}
            return
        yield from self._stream(stream, conv.id)

    def stop(self, request: gr.Request):
        self.service.replies.stop(_session(request))

    def _stream(self, stream, conv_id: str):
        try:
            for update in stream:
                out = {self.chatbot: update.conversation.turns(),
                       self.readout: readout.live_readout(update)}
                if update.done:
                    out.update(self._plots(update.method, update.stats))
                    out[self.conv_list] = self._choices(conv_id)
                yield out
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc))}

    def _plots(self, method: str, stats) -> dict:
        if method == "off" or stats is None or not stats.accepted:
            return {self.plots: gr.Row(visible=False)}
        return {self.plots: gr.Row(visible=True),
                self.hist_plot: readout.accepted_frame(stats),
                self.ctar_plot: readout.ctar_frame(stats)}

    def compare(self, conv_id, method, max_new, request: gr.Request | None = None):
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=int(max_new))
            ask = ReplyRequest(conv_id or "", params, method, owner=_session(request))
            for result in self.service.replies.compare(ask):
                yield readout.compare_html(result)
        except QuickdraftError as exc:
            yield readout.error_html(str(exc))

    # -- acceleration -------------------------------------------------------------
    def select_accel(self, method, active):
        """Use `method` if it is ready; otherwise keep the current one and offer training."""
        try:
            status = self.service.accels.status(method)
        except QuickdraftError as exc:
            return {self.accel: active, self.accel_status: f"⚠ {exc}"}
        if status.ready:
            self.service.store.remember(accel=method)
            return {self.accel: method, self.active: method, self.accel_status: status.message,
                    self.train_btn: gr.Button(visible=False), self.pending: ""}
        return {self.accel: active, self.accel_status: f"⚠ {status.message}",
                self.train_btn: gr.Button(f"Train {accel_label(method)} accelerator",
                                          visible=status.train_needed),
                self.pending: method if status.train_needed else ""}

    # -- conversations ------------------------------------------------------------
    def _conversation(self, conv_id: str) -> Conversation:
        """The open conversation, or a new one when there is none (or it was deleted)."""
        try:
            return self.service.store.get(conv_id) if conv_id else self.service.store.new()
        except QuickdraftError:
            return self.service.store.new()

    def _choices(self, conv_id: str) -> gr.Radio:
        convs = self.service.store.list()
        return gr.Radio(choices=[(c.title, c.id) for c in convs], value=conv_id)

    def show(self, conv: Conversation) -> dict:
        """Everything the view shows for `conv`."""
        self.service.store.remember(last_conversation=conv.id)
        replies = [m for m in conv.messages if m["role"] == "assistant"]
        return {self.conv_id: conv.id, self.chatbot: conv.turns(),
                self.conv_list: self._choices(conv.id), self.title_box: conv.title,
                self.system: conv.system, self.compare_out: "",
                self.readout: readout.saved_readout(replies[-1]) if replies else "",
                self.plots: gr.Row(visible=False), self.export_file: gr.File(visible=False)}

    def open_conv(self, conv_id):
        return self.show(self._conversation(conv_id))

    def new_conv(self, conv_id, system):
        """A new conversation; the open one is reused while it is still empty."""
        current = self._conversation(conv_id) if conv_id else None
        if current is not None and not current.messages:
            return self.show(current)
        return self.show(self.service.store.new(system=system or ""))

    def rename(self, conv_id, title):
        try:
            self.service.store.rename(conv_id, title)
        except QuickdraftError as exc:
            gr.Warning(str(exc))
        return self._choices(conv_id)

    def delete(self, conv_id):
        if conv_id:
            self.service.store.delete(conv_id)
        remaining = self.service.store.list()
        return self.show(remaining[0] if remaining else self.service.store.new())

    def export(self, conv_id, fmt):
        try:
            return gr.File(value=str(self.service.store.export(conv_id, fmt)), visible=True)
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return gr.File(visible=False)

    def restore(self) -> dict:
        """On page load: the last conversation, settings and acceleration."""
        s = self.service.store.load_settings()
        convs = self.service.store.list()
        last = next((c for c in convs if c.id == s.last_conversation), None)
        conv = last or (convs[0] if convs else self.service.store.new(system=s.system))
        out = self.show(conv)
        out.update({self.temperature: s.temperature, self.top_p: s.top_p, self.top_k: s.top_k,
                    self.max_new: s.max_new_tokens})
        out.update(self.select_accel(s.accel, "off"))
        return out


def _session(request: gr.Request | None) -> str:
    """The browser session behind an event ("" outside a request, e.g. in tests)."""
    return getattr(request, "session_hash", None) or ""


def _params(temperature, top_p, top_k, max_new, acceptance) -> SamplingParams:
    return SamplingParams(temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k), max_new_tokens=int(max_new), acceptance=acceptance)

"""The chat tab's reply events: Send (queued while another reply runs), Regenerate, Stop,
the live readout and plots, and Compare. A mixin of ChatTab (app/ui/chat_tab.py), which lays out
the components these handlers fill."""

from __future__ import annotations

import logging

import gradio as gr

from app.replies import ReplyRequest
from app.security import prompt_too_long
from app.settings_rules import PAGE_ACCEPTANCE, page_choice, page_number, page_text
from app.ui import readout
from engine.config import SamplingParams
from engine.errors import QuickdraftError

log = logging.getLogger(__name__)

QUEUED = ("Queued: your message is sent as soon as the reply (or model load) in progress "
          "ends. Stop ends a reply now.")
FAILED = "The reply failed unexpectedly; the app's log has the details."


class ReplyEvents:
    """Send, Regenerate, Stop and Compare (see ChatTab for the components)."""

    def send(self, message, conv_id, system, temperature, top_p, top_k, max_new, acceptance,
             method, request: gr.Request):
        try:
            message = page_text("the message", message)
            system = page_text("the system prompt", system)
            params = _params(temperature, top_p, top_k, max_new, acceptance)
            chars = len(message) + len(system)
            window = self.service.host.wait_ready().context_len  # the start-up model
            if (why := prompt_too_long(chars, window)) is not None:
                raise QuickdraftError(why)  # before the tokenizer reads megabytes of it
            conv = self._conversation(conv_id)
            ask = ReplyRequest(conv.id, params, method, system, session_of(request))
            stream = self.service.replies.chat(ask, message)
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc)), self.queued: ""}
            return
        self.service.store.remember(system=system, temperature=params.temperature,
                                    top_p=params.top_p, top_k=params.top_k,
                                    max_new_tokens=params.max_new_tokens,
                                    acceptance=params.acceptance, last_conversation=conv.id)
        shown = conv.turns() + [{"role": "user", "content": message}]
        yield {self.chatbot: shown, self.conv_id: conv.id,
               self.plots: gr.Row(visible=False), self.undo_row: gr.Row(visible=False),
               self.readout: readout.live_readout_waiting()}
        yield from self._stream(stream, conv.id)

    def regenerate(self, conv_id, system, temperature, top_p, top_k, max_new, acceptance,
                   method, request: gr.Request):
        try:
            system = page_text("the system prompt", system)
            params = _params(temperature, top_p, top_k, max_new, acceptance)
            conv = self._conversation(conv_id)
            ask = ReplyRequest(conv.id, params, method, system, session_of(request))
            stream = self.service.replies.regenerate(ask)
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc))}
            return
        yield from self._stream(stream, conv.id)

    def note_queued(self) -> str:
        """Say why a message sent while the model is busy waits (it is queued)."""
        return QUEUED if self.service.host.busy else ""

    def stop(self, request: gr.Request):
        self.service.replies.stop(session_of(request))

    def _stream(self, stream, conv_id: str):
        """Stream the reply's updates; the first one means it stopped waiting in the queue."""
        try:
            for update in stream:
                out = {self.chatbot: update.conversation.turns(), self.queued: "",
                       self.readout: readout.live_readout(update)}
                if update.done:  # its first prompt may have named the conversation
                    out.update(self._plots(update.method, update.stats))
                    out[self.conv_list] = self._choices(conv_id)
                    out[self.title_box] = update.conversation.title
                yield out
        except QuickdraftError as exc:
            yield {self.readout: readout.error_html(str(exc))}
        except Exception:  # never a raw Python message on the page
            log.exception("a reply failed")
            yield {self.readout: readout.error_html(FAILED)}

    def _plots(self, method: str, stats) -> dict:
        if method == "off" or stats is None or not stats.accepted:
            return {self.plots: gr.Row(visible=False)}
        frame, order = readout.accepted_frame(stats)
        return {self.plots: gr.Row(visible=True),
                self.hist_plot: gr.BarPlot(value=frame, sort=order),
                self.ctar_plot: readout.ctar_frame(stats)}

    def compare(self, conv_id, method, max_new, request: gr.Request | None = None):
        try:
            max_new = page_number("max_new_tokens", max_new, integer=True)
            params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
            ask = ReplyRequest(conv_id or "", params, method, owner=session_of(request))
            for result in self.service.replies.compare(ask):
                yield readout.compare_html(result)
        except QuickdraftError as exc:
            yield readout.error_html(str(exc))
        except Exception:  # never a raw Python message on the page
            log.exception("Compare failed")
            yield readout.error_html(FAILED)


def session_of(request: gr.Request | None) -> str:
    """The browser session behind an event ("" outside a request, e.g. in tests)."""
    return getattr(request, "session_hash", None) or ""


def _params(temperature, top_p, top_k, max_new, acceptance) -> SamplingParams:
    """The page's sampling settings, each checked where it enters (one line if refused)."""
    return SamplingParams(temperature=page_number("temperature", temperature),
                          top_p=page_number("top_p", top_p),
                          top_k=page_number("top_k", top_k, integer=True),
                          max_new_tokens=page_number("max_new_tokens", max_new, integer=True),
                          acceptance=page_choice("acceptance", acceptance, PAGE_ACCEPTANCE))

"""The chat tab's reply events: Send (queued while another reply runs), Regenerate, Stop,
the live readout and plots, and Compare. A mixin of ChatTab (app/ui/chat_tab.py), which lays out
the components these handlers fill."""

from __future__ import annotations

import html
import logging

import gradio as gr

from app.replies import ReplyRequest
from app.security import prompt_too_long
from app.settings_rules import PAGE_ACCEPTANCE, page_choice, page_number, page_text
from app.ui import readout
from engine.config import SamplingParams
from engine.errors import QuickdraftError

log = logging.getLogger(__name__)

QUEUED = ("sent as soon as the reply (or model load) in progress ends; Stop ends a reply "
          "now.")
SHOWN_CHARS = 80  # of a queued message, in its note
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
            yield {self.readout: readout.error_html(str(exc)),
                   self.queued: self.queue_note(session_of(request), drop=message)}
            return
        saves = self.service.page_settings  # after any change still waiting, in order
        saves.put(system=system, temperature=params.temperature, top_p=params.top_p,
                  top_k=params.top_k, max_new_tokens=params.max_new_tokens,
                  acceptance=params.acceptance, last_conversation=conv.id)
        saves.flush()
        shown = conv.turns() + [{"role": "user", "content": message}]
        yield {self.chatbot: shown, self.conv_id: conv.id,
               self.plots: gr.Row(visible=False), self.undo_row: gr.Row(visible=False),
               self.readout: readout.live_readout_waiting()}
        yield from self._stream(stream, conv.id, method, (session_of(request), message))

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
        yield from self._stream(stream, conv.id, method)

    def note_queued(self, message, request: gr.Request):
        """A message sent while the model is busy waits in the queue: it stays on screen,
        marked so, until its reply starts."""
        if not isinstance(message, str) or not message.strip() or not self.service.host.busy:
            return gr.skip()
        return self.queue_note(session_of(request), add=message)

    def queue_note(self, session: str, add: str | None = None, drop: str | None = None) -> str:
        """The note on this browser's queued messages, after adding or dropping one."""
        with self.waiting_lock:
            mine = self.waiting.setdefault(session, [])
            if add is not None:
                mine.append(add)
            if drop is not None and drop in mine:
                mine.remove(drop)
            shown = list(mine)
            if not mine:
                del self.waiting[session]
        return "".join(
            f'<div class="qd-queued-msg"><b>Queued</b>: “{html.escape(_short(m))}”: {QUEUED}'
            "</div>" for m in shown)

    def stop(self, request: gr.Request):
        self.service.replies.stop(session_of(request))

    def _stream(self, stream, conv_id: str, active: str,
                queued: tuple[str, str] | None = None):
        """Stream the reply's updates; the first one means it stopped waiting in the queue
        (`queued`: this browser and the message whose queued note it ends). When it ends,
        the Acceleration panel of the `active` method shows what it measured."""
        try:
            for update in stream:
                out = {self.chatbot: update.conversation.turns(),
                       self.readout: readout.live_readout(update)}
                if queued is not None:
                    out[self.queued] = self.queue_note(queued[0], drop=queued[1])
                    queued = None
                if update.done:  # its first prompt may have named the conversation
                    out.update(self._plots(update.method, update.stats))
                    out[self.conv_list] = self._choices(conv_id)
                    out[self.title_box] = update.conversation.title
                    out[self.accel_status] = self.method_panel(active)
                yield out
        except QuickdraftError as exc:
            yield self._failed(str(exc), queued)
        except Exception:  # never a raw Python message on the page
            log.exception("a reply failed")
            yield self._failed(FAILED, queued)

    def _failed(self, why: str, queued: tuple[str, str] | None) -> dict:
        out = {self.readout: readout.error_html(why)}
        if queued is not None:  # it failed before it started: no longer queued either
            out[self.queued] = self.queue_note(queued[0], drop=queued[1])
        return out

    def _plots(self, method: str, stats) -> dict:
        if method == "off" or stats is None or not stats.accepted:
            return {self.plots: gr.Row(visible=False)}
        frame, order = readout.accepted_frame(stats)
        return {self.plots: gr.Row(visible=True),
                self.hist_plot: gr.BarPlot(value=frame, sort=order),
                self.ctar_plot: readout.ctar_frame(stats)}

    def compare(self, conv_id, method, max_new, request: gr.Request | None = None):
        """Replay the last prompt Off, then with `method`; once both ran, the verdict says
        what Auto does when it was slower, and the Acceleration panel shows the figure."""
        try:
            max_new = page_number("max_new_tokens", max_new, integer=True)
            params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
            ask = ReplyRequest(conv_id or "", params, method, owner=session_of(request))
            for result in self.service.replies.compare(ask):
                if result.on is None:
                    yield {self.compare_out: readout.compare_html(result)}
                    continue
                slower = result.ratio is not None and result.ratio < 1 and not result.stopped
                note = self.service.accels.slower_note(method, result.ratio) if slower else ""
                yield {self.compare_out: readout.compare_html(result, note),
                       self.accel_status: self.method_panel(method)}
        except QuickdraftError as exc:
            yield {self.compare_out: readout.error_html(str(exc))}
        except Exception:  # never a raw Python message on the page
            log.exception("Compare failed")
            yield {self.compare_out: readout.error_html(FAILED)}


def session_of(request: gr.Request | None) -> str:
    """The browser session behind an event ("" outside a request, e.g. in tests)."""
    return getattr(request, "session_hash", None) or ""


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


def _params(temperature, top_p, top_k, max_new, acceptance) -> SamplingParams:
    """The page's sampling settings, each checked where it enters (one line if refused)."""
    return SamplingParams(temperature=page_number("temperature", temperature),
                          top_p=page_number("top_p", top_p),
                          top_k=page_number("top_k", top_k, integer=True),
                          max_new_tokens=page_number("max_new_tokens", max_new, integer=True),
                          acceptance=page_choice("acceptance", acceptance, PAGE_ACCEPTANCE))

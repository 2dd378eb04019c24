"""Replies: the page's chat (saved in its conversations), Compare, and the replies of the
API and the terminal (kept out of them), with what each is asked with and streams back.
Each takes the host's lock, so generations never interleave, and decodes through the one
reply core (app/reply_core.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from app.conversation import Conversation
from app.drafting import Accelerators, accel_label
from app.host import ModelHost
from app.reply_core import Ask, ReplyCore, ReplyStep
from app.speed_record import CpuWatch, measure_of
from app.store import Store, StoreError
from engine.config import ChatMessage, ChatPrompt, SamplingParams
from engine.decode import neartie
from engine.decode.chat_template import conversation, fit_to_context
from engine.decode.neartie import Divergence
from engine.decode.stats import GenerationStats
from engine.errors import AcceleratorError, QuickdraftError

COMPARE_PROMPT = "Explain in a few sentences how a rainbow forms."  # Compare with no chat yet


@dataclass(frozen=True)
class ReplyRequest:
    """What a reply (or a Compare) is asked with."""

    conv_id: str  # the conversation it belongs to ("" for Compare: a stock prompt)
    params: SamplingParams  # sampling and length (Compare keeps the length, decodes greedily)
    method: str = "off"  # acceleration asked for (untrained: plain decoding, with a notice)
    system: str | None = None  # a new system prompt for the conversation; None = keep it
    owner: str = ""  # the browser session asking, so Stop only ends its own reply


@dataclass
class ReplyUpdate:
    """One streaming update of a reply: the chat view and its live readout."""

    conversation: Conversation  # its last message is the reply (it grows while streaming)
    method: str  # acceleration in use for this reply
    stats: GenerationStats  # the figures so far (ReplyStep.stats); the final ones when done
    done: bool = False
    notices: list[str] = field(default_factory=list)  # e.g. prompt truncated, fell back to Off


@dataclass
class CompareResult:
    """The same prompt decoded greedily with acceleration off and on."""

    method: str  # the accelerated method
    prompt: str
    off: GenerationStats | None = None  # filled as each run ends
    on: GenerationStats | None = None
    identical: bool | None = None  # both runs produced the same tokens
    # where the texts first differ and whether the plain model's call there was within the
    # dtype's rounding (measured, not assumed); None while identical, running or stopped
    divergence: Divergence | None = None
    dtype: str = "float32"  # the weights' compute dtype, named in the verdict
    busy: float | None = None  # share of the CPU other programs used while it ran

    @property
    def ratio(self) -> float | None:
        if self.off is None or self.on is None or not self.off.tokens_per_s:
            return None
        return self.on.tokens_per_s / self.off.tokens_per_s

    @property
    def stopped(self) -> bool:
        return any(s is not None and s.stop_reason == "cancelled" for s in (self.off, self.on))


class Replies:
    """Chat, Compare and API replies over the host's model."""

    def __init__(self, store: Store, host: ModelHost, accels: Accelerators):
        self.store = store
        self.host = host
        self.accels = accels
        self.core = ReplyCore(host, accels)
        self._cancel = threading.Event()  # Stop: ends the running generation
        self._owner: str | None = None  # the browser session whose generation is running
        self._conv_id = ""  # the conversation its reply goes to ("" for Compare)

    def chat(self, request: ReplyRequest, prompt: str) -> Iterator[ReplyUpdate]:
        """Add `prompt` to the conversation and stream the reply. The reply is saved when it
        ends, including a partial one after Stop."""
        conversation(prompt)  # refuse an empty prompt before waiting for the model
        return self._reply(request, prompt)

    def regenerate(self, request: ReplyRequest) -> Iterator[ReplyUpdate]:
        """Replace the last reply with a new one."""
        return self._reply(request, None)

    def stop(self, owner: str | None = None) -> None:
        """End the running generation (its partial reply is kept). With `owner`, only when
        that browser session started it: Stop in one tab leaves another tab's reply alone."""
        if owner is None or owner == self._owner:
            self._cancel.set()

    def _reply(self, request: ReplyRequest, prompt: str | None) -> Iterator[ReplyUpdate]:
        with self.host.lock, self._owned(request.owner, request.conv_id):
            conv = self.store.get(request.conv_id)  # under the lock: queued replies keep order
            add_prompt(self.store, conv, prompt)
            if request.system is not None:
                conv.system = request.system.strip()
            # the model and acceptance rule are in the reply: what its accelerator may learn
            # from (app.store), and the datastore learns it when it ends
            ask = Ask(chat_prompt(conv), request.params, request.method, learn=True)
            reply: dict | None = None  # ReplyStep.message: joins the conversation when it starts
            notices: list[str] = []
            try:
                for step in self.core.stream(ask, self._cancel):
                    if reply is None:
                        reply = step.message
                        conv.messages.append(reply)
                    notices += step.notices
                    if step.done:
                        save_reply(self.store, conv, reply)  # before the last update goes out
                    yield ReplyUpdate(conv, step.method, step.stats, step.done, list(notices))
            finally:  # also when the consumer goes away mid-reply, or on an error
                if reply is None or "stats" not in reply:
                    save_reply(self.store, conv, reply)

    def complete(self, ask: Ask, cancel: threading.Event) -> Iterator[ReplyStep]:
        """A reply for another tool (the HTTP API) or the terminal, kept out of the stored
        conversations. Takes the same lock as the page's replies: generations never
        interleave."""
        with self.host.lock:
            yield from self.core.stream(ask, cancel)

    def clear(self, conv_id: str, owner: str = "") -> Conversation:
        """Forget the conversation's messages (Store.clear): this browser's reply in progress
        there stops first, and no reply saves them back."""
        self._stop_in(conv_id, owner)
        with self.host.lock:
            return self.store.clear(conv_id)

    def delete(self, conv_id: str, owner: str = "") -> None:
        """Delete the conversation (Store.delete): this browser's reply in progress there
        stops first, and no reply brings it back."""
        self._stop_in(conv_id, owner)
        with self.host.lock:
            self.store.delete(conv_id)

    def _stop_in(self, conv_id: str, owner: str) -> None:
        if conv_id and conv_id == self._conv_id:
            self.stop(owner)

    @contextlib.contextmanager
    def _owned(self, owner: str, conv_id: str = ""):
        """Mark the running generation as `owner`'s; a fresh Stop state for it."""
        self._cancel.clear()
        self._owner, self._conv_id = owner, conv_id
        try:
            yield
        finally:
            self._owner, self._conv_id = None, ""

    def compare(self, request: ReplyRequest) -> Iterator[CompareResult]:
        """Replay the conversation's last prompt greedily (same length limit and stop
        strings) with acceleration off, then with the request's method."""
        method = request.method
        if method == "off":
            raise QuickdraftError("choose an acceleration method first: Compare runs Off "
                                  "against it")
        with self.host.lock, self._owned(request.owner):
            conv = self.store.get(request.conv_id) if request.conv_id else None
            prompt, history, system = last_prompt(conv)
            lm = self.host.lm
            if not self.accels.status(method).ready:
                raise AcceleratorError(f"{accel_label(method)} is not trained for this model yet")
            params = dataclasses.replace(request.params, temperature=0.0, seed=None)
            ids = self.core.encode(conversation(prompt, history, system))
            dtype = str(lm.model.dtype).removeprefix("torch.")
            drafter = self.accels.drafter(method)
            warm = dataclasses.replace(params, max_new_tokens=2)
            for each in (None, drafter):  # untimed: neither side pays first-call costs
                self.core.replay(ids, warm, each, self._cancel)
            watch = CpuWatch()  # how busy the machine was while both ran
            off_ids, off = self.core.replay(ids, params, None, self._cancel)
            yield CompareResult(method, prompt, off, dtype=dtype)
            on_ids, on = self.core.replay(ids, params, drafter, self._cancel)
            result = CompareResult(method, prompt, off, on, off_ids == on_ids, dtype=dtype,
                                   busy=watch.busy())
            if not result.stopped and result.ratio is not None:
                self.accels.record.add_compare(method, measure_of(on, result.busy,
                                                                  result.ratio))
            if not result.identical and not result.stopped:  # measure the verdict, never assume
                fitted = fit_to_context(ids, lm.context_len, params.max_new_tokens)[0]  # as run()
                result.divergence = neartie.measure(lm, fitted, off_ids, on_ids)
            yield result


def add_prompt(store: Store, conv: Conversation, prompt: str | None) -> None:
    """Append the new prompt, or (regenerate) drop the replies after the last prompt."""
    if prompt is not None:
        if not any(m["role"] == "user" for m in conv.messages):
            conv.title = store.title_for(conv, prompt)
        conv.messages.append({"role": "user", "content": prompt})
        return
    while conv.messages and conv.messages[-1]["role"] == "assistant":
        conv.messages.pop()
    if not conv.messages:
        raise StoreError("nothing to regenerate: send a message first")


def chat_prompt(conv: Conversation) -> ChatPrompt:
    """The conversation as the model reads it: its turns (ending with the user's last
    message, checked when it was added) and its system prompt."""
    turns = tuple(ChatMessage(m["role"], m["content"]) for m in conv.turns())
    return ChatPrompt(turns, conv.system or None)


def save_reply(store: Store, conv: Conversation, reply: dict | None) -> None:
    """Save the conversation; a reply stopped before its first character is dropped (None:
    it never started)."""
    if reply is not None and not reply["content"] and reply in conv.messages:
        conv.messages.remove(reply)
    store.save(conv)


def last_prompt(conv: Conversation | None) -> tuple[str, list[dict], str | None]:
    """(prompt, earlier turns, system) of the conversation's last user message."""
    turns = conv.turns() if conv is not None else []
    for i in range(len(turns) - 1, -1, -1):
        if turns[i]["role"] == "user":
            return turns[i]["content"], turns[:i], conv.system or None
    return COMPARE_PROMPT, [], None

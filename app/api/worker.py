"""One worker thread runs the API's replies in arrival order, through the service's lock.

A single thread (not one per request) keeps requests first-come first-served and bounds
what twenty waiting clients cost: each waits on an asyncio queue, not on a thread. The page's
replies take the same service lock, so a page reply and an API reply never interleave.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field

from app.api.schema import CompletionRequest
from app.reply_core import Ask
from app.service import Service
from engine.errors import QuickdraftError

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """One API request on its way through the worker: its `n` choices are made one after
    another, each a reply to `ask` (a seeded one with seed + its index)."""

    request: CompletionRequest | object  # what the route parsed (its shape is the route's)
    loop: asyncio.AbstractEventLoop  # the server's loop, where `events` is read
    ask: Ask | None = None  # the reply to make (the prompt encoded, the length fitted)
    n: int = 1  # choices
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, ReplyStep) | error
    cancel: threading.Event = field(default_factory=threading.Event)  # set: stop soon
    ticket: int = 0  # arrival number at this server: replies run in ticket order

    def put(self, item) -> None:
        """Hand an item to the waiting handler (called from the worker thread)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


END = object()  # put after the last event (or the error) of a reply


def choice(ask: Ask, index: int) -> Ask:
    """The ask of choice `index`: a seeded reply's seed moves on by the index, so choices
    differ and each one repeats."""
    seed = ask.params.seed
    if index == 0 or seed is None:
        return ask
    seed = (seed + index) % 2**64  # manual_seed takes 0..2**64-1
    return dataclasses.replace(ask, params=dataclasses.replace(ask.params, seed=seed))


class ReplyWorker:
    """Runs queued replies one at a time, in order."""

    def __init__(self, service: Service):
        self.service = service
        self._queue: queue.Queue[Reply | None] = queue.Queue()
        self._tickets = itertools.count(1)
        self._submit_lock = threading.Lock()  # ticket and queue place are taken together
        self._thread = threading.Thread(target=self._run, daemon=True, name="quickdraft-api")
        self._thread.start()

    def submit(self, reply: Reply) -> Reply:
        with self._submit_lock:
            reply.ticket = next(self._tickets)
            self._queue.put(reply)
        return reply

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (reply := self._queue.get()) is not None:
            if reply.cancel.is_set():  # its client left while it waited
                reply.put(END)
                continue
            try:
                for index in range(reply.n):
                    for step in self.service.replies.complete(choice(reply.ask, index),
                                                              reply.cancel):
                        reply.put((index, step))
                    if reply.cancel.is_set():
                        break
            except QuickdraftError as exc:
                reply.put(exc)
            except Exception as exc:  # the worker must outlive any one request
                log.exception("API reply failed")
                reply.put(exc)
            finally:
                reply.put(END)

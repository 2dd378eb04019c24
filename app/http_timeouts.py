"""A deadline for the request head. uvicorn closes a keep-alive connection that stays idle
after a response, but a connection that sends part of a request head and stalls (or sends
nothing at all) is kept open for ever; forty of them pin forty sockets and tasks. Its h11
protocol is extended here to close such a connection once `head_timeout_s` has passed
without a complete head. (Stalled bodies are the guard's: app/guard.py.)"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request head does not arrive."""

    head_timeout_s = 10.0  # set per server by install_head_timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.get_protocol() is not self or not self._awaiting_head():
            self._stop_head_timer()  # a request is running, or a websocket took over
        elif self._head_timer is None and self.timeout_keep_alive_task is None:
            # part of a new head arrived after a response: the keep-alive timer is off now
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _stop_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and self.timeout_keep_alive_task is None \
                and not self.transport.is_closing():
            self.transport.close()


def install_head_timeout(config, head_timeout_s: float) -> None:
    """Use the protocol above for the next connections of the uvicorn server with `config`
    (uvicorn reads the protocol class from its config for every new connection)."""
    if not issubclass(config.http_protocol_class, H11Protocol):
        return  # another HTTP implementation: it keeps its own behaviour
    config.http_protocol_class = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,),
                                      {"head_timeout_s": head_timeout_s})

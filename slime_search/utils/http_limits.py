"""Bounds a public-facing HTTP server needs against clients that are too big or too slow.

- `read_body`: a request body larger than the limit is refused with 413 before it is held in memory (by its
  Content-Length when it declares one, else while it streams in).
- `bounded_h11_protocol`: uvicorn's h11 connection with read deadlines. uvicorn closes idle keep-alive
  connections, but a client that opens a connection and sends its headers or body a byte at a time (slowloris)
  holds the connection and its buffers forever; here the headers must arrive within `header_timeout_s` of the
  connection (or of the first byte of a next request) and the body within `body_timeout_s` of the headers.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class BodyTooLarge(ValueError):
    """Answered with HTTP 413 and this message."""


async def read_body(request, limit: int) -> bytes:
    """The request's body, or BodyTooLarge once it is known to exceed `limit` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def bounded_h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) that closes connections too slow to send a request."""

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _phase: str | None = None  # "headers" or "body": what the running deadline waits for

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm("headers")  # a connection that never sends a request is closed too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._arm("body")
            elif state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm("headers")  # part of a next request's headers
            else:  # a whole request read (DONE), or the connection is ending
                self._disarm()

        def _arm(self, phase: str) -> None:
            if self._phase == phase:
                return
            self._disarm()
            timeout = header_timeout_s if phase == "headers" else body_timeout_s
            self._phase = phase
            self._deadline = self.loop.call_later(timeout, self._too_slow, phase, timeout)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._phase = None, None

        def _too_slow(self, phase: str, timeout: float) -> None:
            self._deadline, self._phase = None, None
            if not self.transport.is_closing():
                logger.warning("closing %s: request %s not received within %.0f s", self.client, phase, timeout)
                self.transport.close()

    return BoundedH11Protocol

"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with a response's status line and headers
sent in the same write as its body.

uvicorn writes the headers when the app sends `http.response.start` and the body when it sends
`http.response.body`: two `write` calls, two TCP segments on the wire, and for the client two wake-ups. An agent's
chat call is answered with one JSON body right after its headers, so a non-streamed answer costs a system call
and a segment more than it needs (the kernel's work for a loopback write is most of its cost: ~3% of the gateway's
CPU a call on `benchmarks/gateway.py`). Here the response cycle writes through `OneWrite`, which holds the headers
until the first body write and sends both with one `writelines` (one `writev`, nothing copied). Headers are never
held past the event loop's next turn: a streamed response whose first event takes a while still sends its headers
at once, as before.

Only the cycle's transport is wrapped; what the protocol writes itself (a 400 for a malformed request) and every
other behaviour is uvicorn's. If uvicorn's protocol ever lacks what this relies on (its `cycle` and the cycle's
`transport`), the headers are simply written as uvicorn writes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class OneWrite:
    """A response cycle's transport: its first write (the status line and headers) is held, then sent together
    with the next write (the body's first bytes), or on the loop's next turn if none comes in this one."""

    __slots__ = ("_held", "_loop", "_started", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._started = False

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self.transport.writelines((held, data))
        elif self._started:
            self.transport.write(data)
        else:
            self._started = True
            self._held = data
            self._loop.call_soon(self.flush)

    def writelines(self, chunks: Any) -> None:
        self.flush()
        self.transport.writelines(chunks)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self.transport.is_closing():
                self.transport.write(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, abort, ...: the transport's own
        return getattr(self.transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose response cycles write through `OneWrite` (module docstring). Given to
    uvicorn as `http=` (rollway.serve)."""

    def on_headers_complete(self) -> None:
        before = getattr(self, "cycle", None)
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle is not before and hasattr(cycle, "transport"):
            cycle.transport = OneWrite(cycle.transport, self.loop)

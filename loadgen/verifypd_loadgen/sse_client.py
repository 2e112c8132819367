"""A small HTTP/1.1 client on asyncio streams for `--backend openai`: keep-alive connections,
one POST at a time per connection, chunked or sized bodies, server-sent events handed on as
`data:` payloads. Only what loadgen needs (no redirects, no proxies, no compression).

Why not httpx: per streamed chunk httpx (httpcore + h11) costs several times the CPU of reading
the chunk straight off an asyncio StreamReader, and one loadgen process could not stream as fast
as the server (docs/loadgen.md, "How fast loadgen is"). aiohttp is faster but is not installed
everywhere loadgen runs; this needs nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the server broke HTTP/1.1 (the transport's error, not a status)."""


class Response:
    """One response: `status`, lower-cased `headers`; the body is read by `events` or `read`."""

    def __init__(self, pool: SsePool, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], status: int, headers):
        self._pool, self._conn, self.status, self.headers = pool, conn, status, headers
        self._done = False

    async def _body_parts(self, on_part: Callable[[bytes], bool]) -> None:
        """Calls on_part(bytes) for each piece of the body as it arrives; on_part returning True
        stops early (the connection is then closed, not reused)."""
        reader = self._conn[0]
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await reader.readline()
                if not line:
                    raise HttpError("connection closed inside a chunked body")
                size = int(line.split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                data = await reader.readexactly(size + 2)
                if on_part(data[:-2]):
                    return
        elif "content-length" in self.headers:
            n = int(self.headers["content-length"])
            if n and on_part(await reader.readexactly(n)):
                return
        else:  # until the server closes
            while data := await reader.read(65536):
                if on_part(data):
                    return
            self._done = True
            self._conn[1].close()
            return
        self._done = True
        if self.headers.get("connection", "").lower() != "close":
            self._pool.release(self._conn)
        else:
            self._conn[1].close()

    async def events(self, on_data: Callable[[bytes], bool]) -> None:
        """Server-sent events: on_data(payload of one `data:` line), stripped; True stops reading."""
        buf = b""

        def on_part(part: bytes) -> bool:
            nonlocal buf
            buf = buf + part if buf else part
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            start, end = 0, buf.find(b"\n\n")
            while end >= 0:
                for line in buf[start:end].split(b"\n"):
                    if line.startswith(b"data:") and on_data(line[5:].strip()):
                        return True
                start, end = end + 2, buf.find(b"\n\n", end + 2)
            buf = buf[start:]
            return False

        await self._body_parts(on_part)

    async def read(self) -> bytes:
        parts: list[bytes] = []

        def on_part(part: bytes) -> bool:
            parts.append(part)
            return False

        await self._body_parts(on_part)
        return b"".join(parts)

    def close(self) -> None:
        """A body not read to its end: the connection cannot be reused."""
        if not self._done:
            self._done = True
            self._conn[1].close()


class SsePool:
    """Keep-alive connections to one origin; a request takes an idle one or opens a new one (no
    cap: loadgen's concurrency decides how many are open)."""

    def __init__(self, base_url: str, tls: ssl.SSLContext | None = None, connect_timeout: float = 10.0):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected http(s)://HOST[:PORT]/PATH, got {base_url!r}")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.path = u.path.rstrip("/")
        self.ssl = (tls or ssl.create_default_context()) if u.scheme == "https" else None
        self.connect_timeout = connect_timeout
        default_port = self.port == (443 if u.scheme == "https" else 80)
        self._host_header = (self.host if default_port else f"{self.host}:{self.port}").encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self):
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20), self.connect_timeout
            )
        except (OSError, TimeoutError, ssl.SSLError) as e:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {type(e).__name__}: {e}") from None

    def release(self, conn) -> None:
        self._idle.append(conn)

    async def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Response:
        """Sends one request and reads the status line and headers. Raises HttpError."""
        head = [f"{method} {self.path}{path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}".encode())
        if body is not None:
            head.append(b"Content-Length: %d" % len(body))
        message = b"\r\n".join(head) + b"\r\n\r\n" + (body or b"")
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            try:
                conn[1].write(message)
                status_line = await conn[0].readline()
                if not status_line:
                    raise ConnectionResetError("closed before answering")
                parts = status_line.split(None, 2)
                if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                    raise HttpError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
                fields = {}
                while (line := await conn[0].readline()) not in (b"\r\n", b"\n"):
                    if not line:
                        raise HttpError("connection closed inside the response headers")
                    k, _, v = line.decode("latin-1").partition(":")
                    fields[k.strip().lower()] = v.strip()
                return Response(self, conn, int(parts[1]), fields)
            except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
                conn[1].close()
                if reused:  # the server closed an idle keep-alive connection: once more on a new one
                    continue
                raise HttpError(f"{type(e).__name__}: {e}") from None
            except BaseException:
                conn[1].close()
                raise

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

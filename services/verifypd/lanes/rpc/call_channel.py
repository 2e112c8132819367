"""The call channel: persistent TCP connections carrying length-prefixed `LaneCall` / `LaneReply`
protobufs (lanes.proto documents the protocol). Torch-free.

Why not a gRPC stream: a bidirectional gRPC stream in Python hands every message between threads
and costs ~0.4-0.5 ms per loopback round trip (bench/lane_call_overhead.py); a framed socket read
and write on the calling thread costs ~0.1 ms. gRPC stays for everything else (Describe,
ImportPools, health, KvTransfer, and unary work calls for tools).

    CallServer(handler, host, secret)   accepts connections; one thread per connection calls
                                        handler(call, state) -> LaneReply; closes after an error reply
    CallClient(host, port, secret)      call(LaneCall) -> LaneReply on the caller's thread

With `tls` (a verifypd.net.lane_tls.LaneTls) both ends wrap the socket in mutual TLS right after
connect/accept, before the secret handshake (lane_tls.py says why the ssl module); without it
the socket is used as is.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable

from verifypd.v1 import lanes_pb2

log = logging.getLogger("verifypd.call_channel")
MAX_FRAME = 512 << 20  # bytes, as the gRPC message limit
NONCE_BYTES, MAC_BYTES = 16, 32
HANDSHAKE_TIMEOUT_S = 10.0  # TLS and the secret proof must come this promptly after accept
_LEN = struct.Struct("<I")


class ChannelClosed(ConnectionError):
    """The peer closed the connection, or sent something that is not a frame."""


def proof(secret: str | None, nonce: bytes) -> bytes:
    """The client's answer to the lane's nonce: HMAC-SHA256(secret, nonce); zeros without a secret."""
    if not secret:
        return bytes(MAC_BYTES)
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def _read_exact(sock_file, n: int) -> bytes:
    data = sock_file.read(n)
    if data is None or len(data) != n:
        raise ChannelClosed("connection closed")
    return data


def read_frame(sock_file) -> bytes:
    (n,) = _LEN.unpack(_read_exact(sock_file, 4))
    if n > MAX_FRAME:
        raise ChannelClosed(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return _read_exact(sock_file, n)


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a call is one small write


class CallServer:
    """Serves the call channel next to a lane's gRPC server. `handler(call, state)` runs under
    the lane's own lock (the caller's business); `new_state()` makes a connection's state."""

    def __init__(
        self,
        handler: Callable,
        new_state: Callable[[], object],
        host: str,
        port: int = 0,
        secret: str | None = None,
        tls=None,
        pipelined: bool = False,
    ):
        """`pipelined`: the handler may return a DeferredReply (call_pipeline.py): without TLS the
        connection's replies are then finished and written on a thread of their own, in call order,
        while the next call is read and launched."""
        self.handler, self.new_state, self.secret, self.tls = handler, new_state, secret, tls
        self.pipelined = pipelined
        self.listener = socket.create_server((host.strip("[]"), port), family=_family(host), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="call-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass
        with self._lock:
            for conn in list(self._conns):
                _close(conn)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            _tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="call-conn", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket | None = raw  # closed at the end; None: refused by _tls_accept, which closed it
        try:
            raw.settimeout(HANDSHAKE_TIMEOUT_S)  # the handshakes must come promptly; calls may then be far apart
            if self.tls is not None:
                conn = self._tls_accept(raw)  # None: refused, closed and logged
            if conn is not None:
                self._converse(conn)
        except (ChannelClosed, OSError):
            pass
        except Exception:  # a malformed frame (DecodeError) or a fault: drop this connection only
            log.exception("call channel: connection dropped")
        finally:
            if conn is not None:
                with self._lock:
                    self._conns.discard(conn)
                _close(conn)

    def _converse(self, conn: socket.socket) -> None:
        """The secret handshake, then calls until the peer goes or a call fails (raises as the socket)."""
        nonce = os.urandom(NONCE_BYTES)
        conn.sendall(nonce)
        f = conn.makefile("rb")
        answer = _read_exact(f, MAC_BYTES)
        if self.secret and not hmac.compare_digest(answer, proof(self.secret, nonce)):
            log.warning("call channel: connection refused (bad lane secret proof)")
            return
        conn.settimeout(None)
        state = self.new_state()
        # Not over TLS: one SSL object must not be read and written by two threads at once (OpenSSL
        # does not make that safe), so there a DeferredReply is finished before the next call is read.
        if self.pipelined and self.tls is None:
            return self._converse_pipelined(conn, f, state)
        while True:
            call = lanes_pb2.LaneCall.FromString(read_frame(f))
            reply = self.handler(call, state)
            finish = getattr(reply, "finish", None)  # a DeferredReply (call_pipeline.py)
            if finish is not None:
                reply = finish()
            reply.call_id = call.call_id
            write_frame(conn, reply.SerializeToString())
            if reply.status_code:
                return  # an error ends the connection and its state; the client reconnects

    def _converse_pipelined(self, conn: socket.socket, f, state) -> None:
        """Calls until the peer goes or a reply fails; replies leave through a ReplyWriter."""
        from verifypd.lanes.rpc.call_pipeline import ReplyWriter

        writer = ReplyWriter(conn, write_frame, _shutdown)
        try:
            while not writer.failed.is_set():
                call = lanes_pb2.LaneCall.FromString(read_frame(f))
                reply = self.handler(call, state)
                if not writer.put(call.call_id, reply) or isinstance(reply, lanes_pb2.LaneReply) and reply.status_code:
                    return  # an error ends the connection and its state; the client reconnects
        finally:
            writer.close()

    def _tls_accept(self, raw: socket.socket) -> socket.socket | None:
        """The TLS server handshake; None (logged, one line naming the problem) when refused."""
        peer = _peer(raw)
        try:
            conn = self.tls.wrap_server(raw)
        except ssl.SSLCertVerificationError as exc:  # e.g. 'certificate has expired', 'unable to get local issuer'
            log.warning("call channel: refused %s: client certificate verify failed: %s", peer, exc.verify_message)
        except ssl.SSLError as exc:  # e.g. PEER_DID_NOT_RETURN_A_CERTIFICATE, a plaintext client (WRONG_VERSION_NUMBER)
            log.warning("call channel: refused %s: TLS handshake failed: %s", peer, exc.reason or exc)
        except TimeoutError:
            log.warning(
                "call channel: refused %s: no TLS handshake within %.0f s (a plaintext client?)",
                peer,
                HANDSHAKE_TIMEOUT_S,
            )
        except OSError:
            pass
        else:
            with self._lock:  # the wrapped socket replaces the raw one (which it detached)
                self._conns.discard(raw)
                self._conns.add(conn)
            return conn
        with self._lock:
            self._conns.discard(raw)
        _close(raw)
        return None


class CallClient:
    """One connection to a lane's call channel, used by one thread at a time (the lane client's
    lock). Connects lazily; `on_connect` runs for every new connection (to reset mirrors)."""

    def __init__(self, host: str, port: int, secret: str | None, timeout_s: float, tls=None):
        self.host, self.port, self.secret, self.timeout_s, self.tls = host, port, secret, timeout_s, tls
        self.sock: socket.socket | None = None
        self._file: io.BufferedReader | None = None
        self._call_id = 0
        self.bytes = 0  # framed bytes sent and received

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host.strip("[]"), self.port), timeout=self.timeout_s)
        try:
            _tune(sock)
            if self.tls is not None:
                sock = self.tls.wrap_client(sock, self.host)
            f = sock.makefile("rb")
            sock.sendall(proof(self.secret, _read_exact(f, NONCE_BYTES)))
        except BaseException:
            _close(sock)
            raise
        self.sock, self._file = sock, f
        return sock

    def call(self, call: lanes_pb2.LaneCall) -> lanes_pb2.LaneReply:
        """One round trip. Raises OSError / ChannelClosed (and closes) when the connection fails."""
        return self.receive(self.send(call))

    def send(self, call: lanes_pb2.LaneCall) -> int:
        """Writes one call and returns its call id; its reply is `receive(id)`. A started call lets
        the caller do other work (send a call to another lane) while this lane computes."""
        sock = self.sock if self.sock is not None else self.connect()
        self._call_id += 1
        call.call_id = self._call_id
        payload = call.SerializeToString()
        try:
            write_frame(sock, payload)
        except BaseException:
            self.close()
            raise
        self.bytes += len(payload) + 4
        return call.call_id

    def receive(self, call_id: int) -> lanes_pb2.LaneReply:
        """Reads the reply to `call_id` (the one call in flight). Raises as `call`."""
        if self.sock is None:
            raise ChannelClosed("connection closed while the call was in flight")
        try:
            data = read_frame(self._file)
        except BaseException:
            self.close()
            raise
        reply = lanes_pb2.LaneReply.FromString(data)
        self.bytes += len(data) + 4
        if reply.call_id != call_id:
            self.close()
            raise ChannelClosed(f"reply {reply.call_id} to call {call_id}")
        if reply.status_code:
            self.close()  # the lane dropped its side
        return reply

    def reply_waiting(self) -> bool:
        """Bytes of a reply have arrived (no wait)."""
        if self.sock is None:
            return True
        # Nothing is buffered ahead in self._file: one reply per call, read whole.
        return bool(select.select([self.sock], [], [], 0)[0])

    def close(self) -> None:
        if self.sock is not None:
            _close(self.sock)
        self.sock = self._file = None


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a peer"
    return f"{host}:{port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    _shutdown(sock)
    sock.close()

"""Mutual TLS between the gateway (engine core) and the lanes, and between lanes (the prefill
lane's KV pushes to the pool owners). Torch-free.

One certificate per config: the gateway and every lane present the same certificate (server and
client auth), and accept only peers whose certificate chains to the config's CA. That is what
the operator issues (docs/kubernetes.md "TLS"); by hand, any CA and one leaf per process work too.

    lane_tls(cert, key, ca, server_name, flags=...)  checked files -> LaneTls (None: TLS off)
    serve_lane_tls(LaneTlsFiles)                     the same for `serve`'s --lane-tls-* files

Where TLS goes: gRPC (Describe, ImportPools, health, KvTransfer, unary work calls) uses grpc's own
TLS; the call channel (call_channel.py, a framed TCP socket) is wrapped in the `ssl` module's
TLS right after connect/accept, before the lane-secret handshake, which stays as it was. Why the
`ssl` module and not a gRPC stream or a TLS proxy: the call channel exists because its framed
reads and writes on the caller's thread cost ~0.1 ms per round trip against ~0.5 ms for a gRPC
stream; `SSLSocket` keeps exactly that shape (same thread, same `sendall`/`makefile` calls), and
with TLS off nothing is wrapped, so TLS off costs nothing.

Rotation without dropping requests: the files are re-read when they change (a Kubernetes Secret
volume swaps them atomically). Servers pick the new certificate up for every new handshake
(gRPC: dynamic server credentials; call channel: a new `SSLContext`); connections already open
keep going. Clients build new connections from the current files (`generation` tells a client
holding a gRPC channel to make a new one). Files that are half-replaced (a certificate that does
not match its key) are ignored with a warning until they are whole again.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from verifypd.domain.options import LaneTlsFiles
from verifypd.net.tls import TlsError, files_stamp, load_ca, load_chain, read_pem

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("verifypd.net.lane_tls")
RELOAD_CHECK_S = 5.0  # how often (at most) the files' stat is checked for a change


@dataclass(frozen=True)
class _Material:
    cert: bytes
    key: bytes
    ca: bytes
    server_ctx: ssl.SSLContext
    client_ctx: ssl.SSLContext


@dataclass
class LaneTls:
    """The config's certificate, its key and the CA every peer must chain to. `server_name`: the
    name checked in the peer's certificate when dialling (default: the host of the address)."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None
    flags: tuple[str, str, str] = ("--tls-cert-file", "--tls-key-file", "--tls-ca-file")
    check_s: float = RELOAD_CHECK_S
    generation: int = 0  # bumped when the files changed and loaded cleanly
    _material: _Material = field(init=False, repr=False)  # set by __post_init__
    _stamp: tuple = field(default=(), repr=False)
    _checked: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._stamp = self._stat()
        self._material = self._load()  # TlsError names the flag

    # -- files -------------------------------------------------------------------------------
    def _stat(self) -> tuple:
        return files_stamp((self.cert_file, self.key_file, self.ca_file))

    def _load(self) -> _Material:
        cert_flag, key_flag, ca_flag = self.flags
        cert, key, ca = (
            read_pem(self.cert_file, cert_flag),
            read_pem(self.key_file, key_flag),
            read_pem(self.ca_file, ca_flag),
        )
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.verify_mode = ssl.CERT_REQUIRED  # mutual: a peer without a certificate is refused
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
        for ctx in (server, client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            load_chain(ctx, self.cert_file, self.key_file, cert_flag, key_flag)
            load_ca(ctx, self.ca_file, ca_flag)
        return _Material(cert, key, ca, server, client)

    def current(self) -> _Material:
        """The loaded files, re-read first when they changed (checked at most every `check_s`)."""
        now = time.monotonic()
        if now - self._checked < self.check_s:
            return self._material
        with self._lock:
            if now - self._checked < self.check_s:
                return self._material
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                try:
                    self._material = self._load()
                except TlsError as exc:  # half-replaced files: keep the old ones, try again later
                    log.warning("TLS files changed but do not load (kept the previous ones): %s", exc)
                else:
                    self._stamp = stamp
                    self.generation += 1
                    log.info("TLS certificate reloaded from %s (generation %d)", self.cert_file, self.generation)
        return self._material

    # -- servers -----------------------------------------------------------------------------
    def grpc_server_credentials(self):
        """Client certificates required; the files are re-checked before every handshake."""
        import grpc

        def config(m: _Material):
            return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

        seen = [self.generation]

        def fetch():
            m = self.current()
            if self.generation == seen[0]:
                return None
            seen[0] = self.generation
            return config(m)

        return grpc.dynamic_ssl_server_credentials(config(self.current()), fetch, require_client_authentication=True)

    def wrap_server(self, sock):
        """The call channel's accepted socket, after a TLS handshake (ssl.SSLError: refused)."""
        return self.current().server_ctx.wrap_socket(sock, server_side=True)

    # -- clients -----------------------------------------------------------------------------
    def grpc_channel(self, addr: str, options=()):
        import grpc

        m = self.current()
        creds = grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(addr, creds, options=[*options, *extra])

    def wrap_client(self, sock, host: str):
        return self.current().client_ctx.wrap_socket(sock, server_hostname=self.server_name or host.strip("[]"))

    def diagnose(self, addr: str, timeout_s: float = 5.0) -> str:
        """Why `addr` does not answer over TLS, in one line (gRPC itself only says UNAVAILABLE):
        first whether our own certificate verifies against the CA (expired, another CA's), then
        what the peer's handshake says."""
        from verifypd.net.tls import ClientTls, diagnose

        m = self.current()
        own = self.self_check()
        if own:
            return own
        return diagnose(
            addr,
            ClientTls(self.ca_file, self.cert_file, self.key_file, m.ca, m.cert, m.key, self.server_name),
            timeout_s,
        )

    def self_check(self) -> str | None:
        """Does our certificate verify against our CA (as every peer will check it)? A TLS handshake
        with ourselves over a socket pair answers with OpenSSL's own words; None when it does."""
        import socket

        m = self.current()
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False  # names are the peer's business; validity and chain are ours
        client.load_verify_locations(cadata=m.ca.decode())
        a, b = socket.socketpair()
        a.settimeout(5.0)
        b.settimeout(5.0)
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(self.cert_file, self.key_file)
        errors: list[str] = []

        def serve():
            try:
                server_ctx.wrap_socket(b, server_side=True).close()
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            client.wrap_socket(a).close()
        except ssl.SSLCertVerificationError as exc:
            errors.append(
                f"our certificate {self.flags[0]} {self.cert_file} does not verify against "
                f"{self.flags[2]} {self.ca_file}: {exc.verify_message}"
            )
        except (ssl.SSLError, OSError):
            pass
        finally:
            a.close()
            t.join(5)
            b.close()
        return errors[0] if errors else None

    def argv(self) -> list[str]:
        """The flags that hand these files to a lane process (`verifypd lane`)."""
        out = ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file, "--tls-ca-file", self.ca_file]
        return out + (["--tls-server-name", self.server_name] if self.server_name else [])


def lane_tls(
    cert_file: str | None,
    key_file: str | None,
    ca_file: str | None,
    server_name: str | None = None,
    flags: tuple[str, str, str] = ("--tls-cert-file", "--tls-key-file", "--tls-ca-file"),
) -> LaneTls | None:
    """Checked lane TLS files; None when none of the three is given. All three or none: a lane
    with TLS accepts only peers with a certificate from the CA, and presents its own."""
    given = dict(zip(flags, (cert_file, key_file, ca_file), strict=True))
    if not any(given.values()):
        if server_name:
            raise TlsError(
                f"--{'lane-' if flags[0].startswith('--lane-') else ''}tls-server-name needs {', '.join(flags)} as well"
            )
        return None
    if not (cert_file and key_file and ca_file):
        missing = [flag for flag, value in given.items() if not value]
        raise TlsError(f"mutual TLS between gateway and lanes needs {', '.join(flags)}; missing {', '.join(missing)}")
    return LaneTls(cert_file, key_file, ca_file, server_name, flags)


SERVE_FLAGS = ("--lane-tls-cert-file", "--lane-tls-key-file", "--lane-tls-ca-file")


def serve_lane_tls(files: LaneTlsFiles) -> LaneTls | None:
    """`serve`'s --lane-tls-* files, checked (TlsError naming serve's flags); None when not given."""
    return lane_tls(files.cert_file, files.key_file, files.ca_file, files.server_name, flags=SERVE_FLAGS)


class LaneChannel:
    """A gRPC channel to a lane (or a pool's owner) that follows certificate rotation. With TLS, a
    new channel is opened once the files changed, so that new connections present the new
    certificate; the old ones stay open until close(), since a call may still run on them."""

    def __init__(self, addr: str, tls: LaneTls | None, options):
        self.addr, self._tls, self._options = addr, tls, options
        self._old: list[grpc.Channel] = []
        self._open()

    def _open(self) -> None:
        import grpc

        if self._tls is None:
            self.channel = grpc.insecure_channel(self.addr, options=self._options)
        else:
            self._generation = self._tls.generation
            self.channel = self._tls.grpc_channel(self.addr, self._options)

    def refresh(self) -> bool:
        """True when a new channel replaced the old one (stubs on it must be rebuilt)."""
        if self._tls is None:
            return False
        self._tls.current()
        if self._tls.generation == self._generation:
            return False
        self._old.append(self.channel)
        self._open()
        return True

    def close(self) -> None:
        for channel in (*self._old, self.channel):
            channel.close()

"""TLS for the gateway's public listeners (gRPC and HTTP) and for the clients that call them
(`verifypd generate --server`, loadgen, the operator's Control client). Torch-free.

Files are PEM. Everything is read and checked up front (`server_tls`, `client_tls`): a missing
flag, an unreadable file or a key that does not belong to its certificate is a `TlsError` with a
one-line message naming the flag, which the CLIs print and exit 2 on, before anything binds.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("verifypd.net.tls")


class TlsError(ValueError):
    """A TLS flag is missing, or its file is unreadable or not what it should be."""


RELOAD_CHECK_S = 5.0  # how often (at most) servers look at their certificate files' stat


def files_stamp(paths) -> tuple[tuple[int, int, int] | None, ...]:
    """(inode, size, mtime) of each file, None where it cannot be read: changes when a file is
    rewritten or its mount swapped to a new version (Kubernetes Secret volumes rename a directory)."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class FileStamp:
    """Notices that files changed (inode, size, mtime: a Kubernetes Secret volume swaps them
    atomically), checked at most every `check_s`. `reload(load)` calls `load()` after a change and
    returns its result, or None when nothing changed or `load` raised TlsError (logged, retried
    at the next check: a certificate written before its key does not load yet)."""

    def __init__(self, paths, check_s: float | None = None):
        self.paths = [p for p in paths if p]
        self.check_s = RELOAD_CHECK_S if check_s is None else check_s
        self.stamp = self._stat()
        self._checked = 0.0
        self._lock = threading.Lock()

    def _stat(self) -> tuple:
        return files_stamp(self.paths)

    def reload(self, load):
        now = time.monotonic()
        if now - self._checked < self.check_s:
            return None
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp == self.stamp:
                return None
            try:
                result = load()
            except (TlsError, ssl.SSLError, OSError) as exc:
                log.warning("TLS files changed but do not load (kept the previous ones): %s", exc)
                return None
            self.stamp = stamp
            log.info("TLS certificate reloaded from %s", self.paths[0])
            return result


def read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{flag} {path} is not a PEM file")
    return data


def _pair(cert_file: str | None, key_file: str | None, cert_flag: str, key_flag: str) -> tuple[str, str] | None:
    """(cert_file, key_file) when both are given, None when neither is; one without the other is an error."""
    if bool(cert_file) != bool(key_file):
        given, missing = (cert_flag, key_flag) if cert_file else (key_flag, cert_flag)
        raise TlsError(f"{given} needs {missing} as well")
    return (cert_file, key_file) if cert_file and key_file else None


def load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str, cert_flag: str, key_flag: str) -> None:
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:  # e.g. KEY_VALUES_MISMATCH, or a PEM that is not a key
        raise TlsError(
            f"{key_flag} {key_file} does not hold the private key of {cert_flag} {cert_file} ({exc.reason or exc})"
        ) from None


def load_ca(ctx: ssl.SSLContext, ca_file: str, flag: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsError(f"{flag} {ca_file} holds no usable CA certificate ({exc.reason or exc})") from None


@dataclass(frozen=True)
class ServerTls:
    """The gateway's certificate and key, and the CA that client certificates must chain to
    (None: no client certificates asked for)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None
    cert: bytes
    key: bytes
    client_ca: bytes | None

    def grpc_credentials(self):
        """Re-read when the files change (a rotated certificate): checked before new handshakes,
        at most every RELOAD_CHECK_S; open connections keep theirs."""
        import grpc

        def config(tls: ServerTls):
            return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.client_ca)

        watch = FileStamp((self.cert_file, self.key_file, self.client_ca_file))

        def fetch():
            fresh = watch.reload(lambda: server_tls(self.cert_file, self.key_file, self.client_ca_file))
            return config(fresh) if fresh is not None else None

        return grpc.dynamic_ssl_server_credentials(
            config(self), fetch, require_client_authentication=self.client_ca is not None
        )

    def reload_into(self, ctx: ssl.SSLContext, watch: FileStamp) -> bool:
        """Loads changed files into a live SSLContext (uvicorn's; call on its event loop, which
        alone uses it). True when reloaded."""

        def load():
            # Checked first: a half-written pair never reaches the live context.
            server_tls(self.cert_file, self.key_file, self.client_ca_file)
            ctx.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            return True

        return bool(watch.reload(load))

    def uvicorn_options(self) -> dict:
        """uvicorn.Config keywords: HTTPS with the same files, client certificates required
        exactly when a client CA is given."""
        return dict(
            ssl_certfile=self.cert_file,
            ssl_keyfile=self.key_file,
            ssl_ca_certs=self.client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if self.client_ca_file else ssl.CERT_NONE,
        )

    @property
    def label(self) -> str:
        return "tls, client certificates required" if self.client_ca_file else "tls"


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None = None) -> ServerTls | None:
    """`serve`'s --tls-cert-file/--tls-key-file/--tls-client-ca-file, checked; None when none given."""
    if not (cert_file or key_file or client_ca_file):
        return None
    pair = _pair(cert_file, key_file, "--tls-cert-file", "--tls-key-file")
    if pair is None:  # neither given: the client CA alone
        raise TlsError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file as well")
    cert_file, key_file = pair
    cert, key = read_pem(cert_file, "--tls-cert-file"), read_pem(key_file, "--tls-key-file")
    client_ca = read_pem(client_ca_file, "--tls-client-ca-file") if client_ca_file else None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_chain(ctx, cert_file, key_file, "--tls-cert-file", "--tls-key-file")
    if client_ca_file:
        load_ca(ctx, client_ca_file, "--tls-client-ca-file")
    return ServerTls(cert_file, key_file, client_ca_file, cert, key, client_ca)


@dataclass(frozen=True)
class ClientTls:
    """The CA that the server's certificate must chain to, and an optional client certificate."""

    ca_file: str
    cert_file: str | None
    key_file: str | None
    ca: bytes
    cert: bytes | None
    key: bytes | None
    server_name: str | None = None  # checked against the certificate instead of the target's host

    def grpc_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def grpc_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """For httpx (`verify=`) and for `diagnose`."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def client_tls(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None, server_name: str | None = None
) -> ClientTls | None:
    """A client's --tls-ca-file [--tls-cert-file --tls-key-file], checked; None when none given."""
    if not (ca_file or cert_file or key_file):
        return None
    if not ca_file:
        raise TlsError(f"{'--tls-cert-file' if cert_file else '--tls-key-file'} needs --tls-ca-file as well")
    pair = _pair(cert_file, key_file, "--tls-cert-file", "--tls-key-file")
    ca = read_pem(ca_file, "--tls-ca-file")
    cert = read_pem(pair[0], "--tls-cert-file") if pair else None
    key = read_pem(pair[1], "--tls-key-file") if pair else None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    load_ca(ctx, ca_file, "--tls-ca-file")
    if pair:
        load_chain(ctx, *pair, "--tls-cert-file", "--tls-key-file")
    return ClientTls(ca_file, cert_file, key_file, ca, cert, key, server_name)


def grpc_channel(target: str, tls: ClientTls | None, *, aio: bool = False, options=()):
    """A plaintext channel without `tls`, a TLS one with it (grpc or grpc.aio)."""
    import grpc

    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(target, options=list(options))
    return module.secure_channel(target, tls.grpc_credentials(), options=[*options, *tls.grpc_options()])


def diagnose(target: str, tls: ClientTls | None, timeout_s: float = 5.0) -> str:
    """Why a channel to `target` does not become ready, in one line: the TLS handshake's own error
    (gRPC only says 'unavailable'), or that nothing answers the TCP connect."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        return f"cannot connect to {target}: {getattr(exc, 'strerror', None) or exc}"
    if tls is None:
        raw.close()
        return f"{target} accepts connections but does not answer gRPC (does it require TLS? give --tls-ca-file)"
    ctx = tls.ssl_context()
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(raw, server_hostname=tls.server_name or host) as conn:
            conn.settimeout(1.0)
            # A server that refuses our client certificate says so after the handshake (TLS 1.3),
            # with an alert (SSLError below) or by closing the connection.
            if conn.recv(1) == b"":
                return (
                    f"{target} closed the connection right after the TLS handshake: it did not accept "
                    f"our client certificate (missing, expired or from another CA?)"
                )
    except ssl.SSLCertVerificationError as exc:  # verify_message: e.g. 'certificate has expired'
        return f"TLS handshake with {target} failed: certificate verify failed: {exc.verify_message}"
    except ssl.SSLError as exc:  # e.g. the server's alert on a missing or foreign client certificate
        return f"TLS handshake with {target} failed: {exc.reason or exc}"
    except (TimeoutError, OSError):
        pass
    finally:
        raw.close()
    return f"{target} completes the TLS handshake but does not answer gRPC"

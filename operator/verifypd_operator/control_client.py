"""Client of `verifypd.v1.Control` on every router replica of a config.

A ClusterIP Service would send one RPC to one replica; the operator instead resolves the headless
`<name>-gateway-pods` Service to all ready pod IPs and calls each, so every router runs with the
same knobs. A router that restarted comes back with its CLI defaults: `sync` compares with
`GetConfig` and pushes only where the config differs.

Control is an admin API: every call carries `authorization: Bearer <admin key>`, the key of the
config's admin Secret that the operator creates and mounts into the gateway pods
(`config_secrets.build_admin_secret`, `verifypd serve --admin-key-file`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
from collections.abc import Callable

import grpc

from verifypd.net.tls import grpc_channel
from verifypd.v1 import control_pb2, control_pb2_grpc

from .decision import Knobs

log = logging.getLogger(__name__)


def knobs_to_pb(k: Knobs) -> control_pb2.RuntimeConfig:
    return control_pb2.RuntimeConfig(
        k_min=k.k_min,
        k_max=k.k_max,
        k_initial=k.k_initial,
        adaptive=k.adaptive,
        priorities=control_pb2.LanePriorities(draft=k.prio_draft, verify=k.prio_verify, prefill=k.prio_prefill),
        prefill_token_budget=k.prefill_token_budget,
    )


def pb_matches(cfg: control_pb2.RuntimeConfig, k: Knobs) -> bool:
    """Whether the router's config already equals the knobs (unset fields never match)."""
    p = cfg.priorities
    return (
        cfg.HasField("k_min")
        and cfg.HasField("k_max")
        and cfg.HasField("k_initial")
        and cfg.HasField("adaptive")
        and cfg.HasField("prefill_token_budget")
        and (cfg.k_min, cfg.k_max, cfg.k_initial, cfg.adaptive, cfg.prefill_token_budget)
        == (k.k_min, k.k_max, k.k_initial, k.adaptive, k.prefill_token_budget)
        and (p.draft, p.verify, p.prefill) == (k.prio_draft, k.prio_verify, k.prio_prefill)
    )


def resolve(host_port: str) -> list[str]:
    """`host:port` -> one `ip:port` per address the name resolves to (all pods of a headless Service)."""
    host, _, port = host_port.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        log.info("cannot resolve %s: %s", host_port, e)
        return []
    out = []
    for *_, sockaddr in infos:
        ip = sockaddr[0]
        t = f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"
        if t not in out:
            out.append(t)
    return out


@dataclasses.dataclass
class SyncResult:
    pushed: list[str] = dataclasses.field(default_factory=list)  # targets updated
    in_sync: list[str] = dataclasses.field(default_factory=list)  # targets already equal
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # target -> error
    revision: int | None = None  # highest revision reported

    @property
    def reached(self) -> int:
        return len(self.pushed) + len(self.in_sync)


def _auth(admin_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {admin_key}"),) if admin_key else ()


class ControlClient:
    """`resolver`: `host:port` -> the replicas' `ip:port`s (the headless Service's DNS by default;
    tests that run routers on local ports replace only this). `tls`: a verifypd.net.tls.ClientTls
    (`client_tls(ca_file, cert_file, key_file, server_name=...)`) for gateways serving TLS; the
    replicas are dialled by IP, so give `server_name` (a name in their certificate, e.g. the
    Service's DNS name). None: plaintext."""

    def __init__(self, timeout_s: float = 5.0, resolver: Callable[[str], list[str]] = resolve, tls=None):
        self.timeout_s, self.resolver, self.tls = timeout_s, resolver, tls

    def _stub(self, channel: grpc.Channel) -> control_pb2_grpc.ControlStub:
        return control_pb2_grpc.ControlStub(channel)

    def get(self, target: str, admin_key: str | None = None, tls=None) -> control_pb2.RuntimeConfig:
        with grpc_channel(target, tls or self.tls) as ch:
            return self._stub(ch).GetConfig(
                control_pb2.GetConfigRequest(), timeout=self.timeout_s, metadata=_auth(admin_key)
            )

    def update(
        self, target: str, knobs: Knobs, requested_by: str, reason: str, admin_key: str | None = None, tls=None
    ) -> control_pb2.RuntimeConfig:
        req = control_pb2.UpdateConfigRequest(config=knobs_to_pb(knobs), requested_by=requested_by, reason=reason)
        with grpc_channel(target, tls or self.tls) as ch:
            return self._stub(ch).UpdateConfig(req, timeout=self.timeout_s, metadata=_auth(admin_key))

    def sync(
        self,
        host_port: str,
        knobs: Knobs,
        requested_by: str,
        reason: str,
        force: bool = False,
        admin_key: str | None = None,
        tls=None,
    ) -> SyncResult:
        """Push `knobs` to every replica behind `host_port` whose config differs (all if force).
        `tls`: this config's ClientTls (its gateways serve TLS), else the client's own."""
        res = SyncResult()
        for target in self.resolver(host_port):
            try:
                if not force and pb_matches(cur := self.get(target, admin_key, tls), knobs):
                    res.in_sync.append(target)
                    rev = cur.revision
                else:
                    rev = self.update(target, knobs, requested_by, reason, admin_key, tls).revision
                    res.pushed.append(target)
                res.revision = max(rev, res.revision or 0)
            except grpc.RpcError as e:
                res.errors[target] = f"{e.code().name}: {e.details()}"
        return res

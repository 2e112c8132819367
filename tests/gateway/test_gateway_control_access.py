"""Control is an admin API: `Control.UpdateConfig` needs the admin key
(`--admin-key-file`), which neither an outsider nor a caller holding Generate's API key has; the
operator's Control client presents it and gets through. The rule itself (auth.gateway_access) as
a table, then real `verifypd serve` processes in both topologies, then the CLI's refusals."""

from __future__ import annotations

import grpc
import pytest
from services_helpers import (
    Client,
    Server,
    free_port,
    greedy_request,
    serve_cmd,
)

from verifypd.net.auth import gateway_access
from verifypd.v1 import control_pb2

ADMIN_KEY, API_KEY = "admin-key-for-tests-0123456789", "api-key-for-tests-0123456789"
UPDATE, GET, GENERATE = (
    "/verifypd.v1.Control/UpdateConfig",
    "/verifypd.v1.Control/GetConfig",
    "/verifypd.v1.Generation/Generate",
)
OK, UNAUTH, DENIED = None, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def _meta(key):
    return {} if key is None else {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "method, key, api_key, admin_key, want",
    [
        (UPDATE, None, None, None, DENIED),  # no admin key configured: closed to everyone
        (UPDATE, ADMIN_KEY, None, None, DENIED),
        (UPDATE, None, None, ADMIN_KEY, UNAUTH),  # outsider, no API key on the server
        (UPDATE, "wrong", API_KEY, ADMIN_KEY, UNAUTH),
        (UPDATE, API_KEY, API_KEY, ADMIN_KEY, DENIED),  # a Generate caller: authenticated, not allowed
        (UPDATE, ADMIN_KEY, API_KEY, ADMIN_KEY, OK),
        (UPDATE, ADMIN_KEY, None, ADMIN_KEY, OK),
        (GET, None, None, ADMIN_KEY, OK),  # GetConfig: as readable as Generate
        (GET, None, API_KEY, ADMIN_KEY, UNAUTH),
        (GET, API_KEY, API_KEY, ADMIN_KEY, OK),
        (GET, ADMIN_KEY, API_KEY, ADMIN_KEY, OK),
        (GENERATE, None, None, ADMIN_KEY, OK),
        (GENERATE, None, API_KEY, None, UNAUTH),
        (GENERATE, API_KEY, API_KEY, None, OK),
        ("/grpc.health.v1.Health/Check", None, API_KEY, ADMIN_KEY, OK),
    ],
)
def test_gateway_access_rule(method, key, api_key, admin_key, want):
    denial = gateway_access(method, _meta(key), api_key=api_key, admin_key=admin_key)
    assert (denial and denial[0]) == want, denial


def test_a_bare_key_without_bearer_is_no_credential():
    assert gateway_access(UPDATE, {"authorization": ADMIN_KEY}, api_key=None, admin_key=ADMIN_KEY)[0] == UNAUTH


@pytest.fixture(scope="module", params=["colocated", "split"])
def served(request, tiny_models, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("admin") / "admin-key"
    key_file.write_text(ADMIN_KEY + "\n")
    port = free_port()
    server = Server(
        serve_cmd(tiny_models, port, "--api-key", API_KEY, "--admin-key-file", str(key_file), topology=request.param),
        echo=False,
    ).wait_ready()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.mark.slow
def test_control_is_closed_to_outsiders_and_generate_callers(served):
    from verifypd_operator.control_client import ControlClient
    from verifypd_operator.decision import Knobs

    update = control_pb2.UpdateConfigRequest(config=control_pb2.RuntimeConfig(k_max=3), requested_by="test")
    outsider, user = Client(served), Client(served, bearer=API_KEY)
    try:
        for client, code in ((outsider, UNAUTH), (user, DENIED)):
            with pytest.raises(grpc.RpcError) as err:
                client.control.UpdateConfig(update, timeout=30)
            assert err.value.code() == code, err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            outsider.control.GetConfig(control_pb2.GetConfigRequest(), timeout=30)
        assert err.value.code() == UNAUTH
        before = user.control.GetConfig(control_pb2.GetConfigRequest(), timeout=30)  # readable by Generate's callers
        assert len(user.generate(**greedy_request([5, 6, 7], 4))[0]) == 4

        knobs = Knobs(
            k_min=1,
            k_max=3,
            k_initial=2,
            adaptive=True,
            prio_draft=2,
            prio_verify=1,
            prio_prefill=0,
            prefill_token_budget=256,
        )
        operator = ControlClient(timeout_s=30, resolver=lambda _: [served])
        keyless = operator.sync("gateway-pods:50051", knobs, "operator/test", "test")
        assert keyless.reached == 0 and "UNAUTHENTICATED" in keyless.errors[served]
        synced = operator.sync("gateway-pods:50051", knobs, "operator/test", "test", admin_key=ADMIN_KEY)
        assert synced.pushed == [served] and not synced.errors
        after = user.control.GetConfig(control_pb2.GetConfigRequest(), timeout=30)
        assert (after.k_max, after.k_initial, after.prefill_token_budget) == (3, 2, 256)
        assert after.revision == before.revision + 1  # exactly the admin's one change
    finally:
        outsider.close()
        user.close()


@pytest.mark.parametrize(
    "key, api_key, message",
    [
        ("short", None, "admin key is too short"),
        (API_KEY, API_KEY, "must differ from the API key"),
    ],
)
def test_serve_refuses_a_bad_admin_key(tiny_models, tmp_path, capsys, key, api_key, message):
    from verifypd.cli import main

    (tmp_path / "k").write_text(key)
    extra = ["--admin-key-file", str(tmp_path / "k")] + (["--api-key", api_key] if api_key else [])
    assert main(serve_cmd(tiny_models, free_port(), *extra)[3:]) == 2
    assert message in capsys.readouterr().err

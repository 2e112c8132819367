"""`verifypd serve --simulated-acceptance ALPHA` (benchmark only), through the real CLI: with a draft that
is a *different* random model of the target's shape (real acceptance far from 1), ALPHA 1 accepts every
draft token and ALPHA 0 none; split topology passes it to the verify lane process; the server warns
loudly and labels its start-up line; values outside [0, 1] are a CLI error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from services_helpers import BLOCK_SIZE, MAX_CONTEXT, Client, Server, _engine_models, free_port, greedy_request

pytestmark = pytest.mark.slow  # `verifypd serve` processes (tests/README.md)

K = 4


@pytest.fixture(scope="module")
def unrelated_models(tmp_path_factory) -> tuple[str, str]:
    """Target and a draft of the same shape but other random weights: they rarely agree."""
    root = tmp_path_factory.mktemp("simulated")
    target = _engine_models.write_tiny_llama(root / "target", seed=1, layers=2)
    draft = _engine_models.write_tiny_llama(root / "draft", seed=2, layers=2)
    return str(target), str(draft)


def serve(models, alpha: str, *extra: str) -> tuple[Server, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        "0",
        "--target",
        models[0],
        "--draft",
        models[1],
        "--device",
        "cpu",
        "--num-blocks",
        "64",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-context",
        str(MAX_CONTEXT),
        "--k-initial",
        str(K),
        "--no-adaptive",
        "--simulated-acceptance",
        alpha,
        *extra,
    ]
    server = Server(cmd, echo=False)
    if not server.ready.wait(180):
        server.proc.kill()
        pytest.fail("server did not start:\n" + "".join(server.lines[-30:]))
    return server, f"127.0.0.1:{port}"


def usage_of(address: str, n: int = 3) -> tuple[int, int]:
    """(draft tokens, accepted tokens) summed over n greedy requests."""
    client = Client(address)
    drafted = accepted = 0
    try:
        for i in range(n):
            ids, msgs = client.generate(**greedy_request([5 + i, 17, 33, 40 + i], max_tokens=24))
            assert len(ids) == 24
            drafted += msgs[-1].usage.draft_tokens
            accepted += msgs[-1].usage.accepted_tokens
    finally:
        client.close()
    return drafted, accepted


def stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@pytest.mark.parametrize("alpha", ["1.0", "0.0"])
def test_colocated_serve_simulates_acceptance(unrelated_models, alpha):
    server, address = serve(unrelated_models, alpha)
    try:
        drafted, accepted = usage_of(address)
    finally:
        stop(server)
    assert drafted > 0
    if alpha == "1.0":
        assert accepted == drafted  # the unrelated draft alone would be rejected nearly always
    else:
        assert accepted == 0
    assert server.count(rf"WARNING .*SIMULATED ACCEPTANCE alpha={float(alpha):g} .*BENCHMARK ONLY") == 1
    assert server.count(rf"verifypd: serving colocated .*SIMULATED ACCEPTANCE alpha={float(alpha):g}") == 1


def test_real_acceptance_of_the_unrelated_draft_is_low(unrelated_models):
    """The control: without the flag the same pair accepts rarely (so alpha 1 above is the flag's doing)."""
    from services_helpers import engine_options

    from verifypd.domain.requests import RequestSpec, SamplingParams
    from verifypd.engine import Engine

    options = engine_options(*unrelated_models, k=K, block_size=BLOCK_SIZE)
    done = Engine(options).generate(
        [
            RequestSpec(prompt_ids=(5 + i, 17, 33, 40 + i), max_tokens=24, stop_at_eos=False, sampling=SamplingParams())
            for i in range(3)
        ]
    )
    drafted = sum(c.usage["draft_tokens"] for c in done.values())
    accepted = sum(c.usage["accepted_tokens"] for c in done.values())
    assert drafted > 0 and accepted / drafted < 0.5


def test_split_serve_passes_it_to_the_verify_lane(unrelated_models):
    server, address = serve(unrelated_models, "1", "--topology", "split")
    try:
        drafted, accepted = usage_of(address, n=2)
    finally:
        stop(server)
    assert drafted > 0 and accepted == drafted
    assert server.count(r"verify lane serving on .*SIMULATED ACCEPTANCE alpha=1") == 1
    assert server.count(r"(prefill|draft) lane serving on .*SIMULATED") == 0


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "high"])
def test_out_of_range_is_a_cli_error(value):
    from verifypd.lanes.processes import child_env

    proc = subprocess.run(
        [sys.executable, "-m", "verifypd.cli", "serve", "--simulated-acceptance", value],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == 2
    assert "--simulated-acceptance" in proc.stderr and "[0, 1]" in proc.stderr

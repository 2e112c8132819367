"""`verifypd serve --kv-cache-dtype fp8` end to end on the CPU: colocated, split (the prefill lane
writes the fp8 pools the verify and draft lanes own, through the shared-memory handle, or pushes
their bytes with the copy transport) and
colocated under `--tensor-parallel 2` (each rank's own fp8 pool). Speculative greedy output over
gRPC equals the offline engine's plain greedy output with fp8 KV, and every process logs its fp8
pool (blocks, tokens, dtype) at start-up."""

from __future__ import annotations

import pytest
from services_helpers import (
    Client,
    Server,
    concurrent_greedy,
    engine_options,
    free_port,
    offline_outputs,
    random_prompts,
    serve_cmd,
)

from verifypd.domain.requests import RequestSpec, SamplingParams

pytestmark = pytest.mark.slow  # `verifypd serve` with lane and rank processes (tests/README.md)


@pytest.mark.parametrize(
    "topology,extra",
    [
        ("colocated", ()),
        ("split", ()),
        ("split", ("--kv-transport", "copy")),
        ("colocated", ("--tensor-parallel", "2")),
    ],
    ids=["colocated", "split", "split-copy", "colocated-tp2"],
)
def test_fp8_kv_serve_equals_plain_greedy(tiny_models, topology, extra):
    prompts = random_prompts(6, seed=31, max_len=24)
    max_tokens = 16
    expected = offline_outputs(
        engine_options(*tiny_models, k=0, num_blocks=128, kv_cache_dtype="fp8"),
        [
            RequestSpec(prompt_ids=tuple(p), max_tokens=max_tokens, stop_at_eos=False, sampling=SamplingParams())
            for p in prompts
        ],
    )
    port = free_port()
    cmd = serve_cmd(tiny_models, port, "--kv-cache-dtype", "fp8", *extra, topology=topology)
    server = Server(cmd, echo=False).wait_ready()
    try:
        client = Client(f"127.0.0.1:{port}")
        assert concurrent_greedy(client, prompts, max_tokens) == expected
        client.close()
    finally:
        server.stop()
    pools = [ln for ln in server.lines if "KV pool:" in ln]
    assert pools and all("float8_e4m3fn" in ln and "128 blocks x 4 = 512 tokens" in ln for ln in pools), pools
    # split: the verify lane's target pool and the draft lane's draft pool; tp2: rank 1's pool too.
    assert {"target", "draft"} <= {ln.split(" KV pool:")[0].split()[-1] for ln in pools}
    if "--tensor-parallel" in extra:
        assert any("tensor-parallel rank 1 ready" in ln for ln in pools), pools
    assert server.proc.returncode == 0, "".join(server.lines[-20:])

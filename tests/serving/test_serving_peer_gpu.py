"""Split lanes on two GPUs (needs 2 CUDA devices; skipped elsewhere): prefill on cuda:0, verify and draft
on cuda:1, KV by the peer transport (`auto` picks it), greedy output equal to the colocated engine's on
cuda:1; then the draft lane on cuda:0 beside prefill (drafts on their own GPU, the draft pool imported,
the target pool copied); and both again with the direct transport (the prefill lane's forward writes
the owners' pools over NVLink, nothing staged). Run on a 2-GPU machine:

    VERIFYPD_TEST_DEVICE=cuda python -m pytest -q tests/serving/test_serving_peer_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from services_helpers import engine_options, random_prompts

from verifypd.domain.requests import RequestSpec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def options(tiny_models, **overrides):
    # float32: exact comparisons between the two topologies
    return engine_options(*tiny_models, device="cuda:1", dtype="float32", **overrides)


@pytest.mark.parametrize(
    "lane_devices, kv_transport, modes",
    [
        ({"prefill": "cuda:0", "verify": "cuda:1", "draft": "cuda:1"}, "auto", {"peer"}),
        ({"prefill": "cuda:0", "verify": "cuda:1", "draft": "cuda:0"}, "auto", {"peer", "imported"}),
        ({"prefill": "cuda:0", "verify": "cuda:1", "draft": "cuda:1"}, "direct", {"direct"}),
        ({"prefill": "cuda:0", "verify": "cuda:1", "draft": "cuda:0"}, "direct", {"direct"}),
    ],
)
def test_split_across_gpus_gives_the_colocated_output(tiny_models, lane_devices, kv_transport, modes):
    from services_helpers import Client, greedy_request, offline_outputs

    from verifypd.gateway.server import build_split
    from verifypd.lanes.processes import LaneProcesses

    prompts = random_prompts(4, seed=5, max_len=40)
    expected = offline_outputs(
        options(tiny_models), [RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False) for p in prompts]
    )
    procs = LaneProcesses(options(tiny_models, lane_devices=lane_devices))
    procs.start(timeout_s=300)
    try:
        with build_split(
            procs.addrs, options(tiny_models), kv_transport=kv_transport, lane_secret=procs.secret
        ).start() as gw:
            assert set(gw.wiring.mode_by_pool.values()) == modes
            client = Client(gw.address)
            try:
                got = [client.generate(**greedy_request(p))[0] for p in prompts]
            finally:
                client.close()
            assert got == expected
            copied = gw.lanes[0].kv_bytes_copied
            assert copied == 0 if kv_transport == "direct" else copied > 0  # direct: written in place
    finally:
        procs.terminate()

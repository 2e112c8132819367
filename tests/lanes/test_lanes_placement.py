"""`serve --topology split --lane-devices ...`: each lane process on its own device (launch/lane_devices.py,
lanes/processes.py); bad placements are one line naming the flag, exit 2, before anything loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from verifypd.domain.options import EngineOptions
from verifypd.lanes.processes import LANES, lane_command
from verifypd.launch.lane_devices import LANE_NAMES, lane_devices_error, parse_lane_devices


def test_lane_names_are_the_lanes():
    assert LANE_NAMES == LANES


def test_parse():
    assert parse_lane_devices("prefill=cuda:0, verify=1,draft=cpu") == {
        "prefill": "cuda:0",
        "verify": "cuda:1",
        "draft": "cpu",
    }
    for bad, words in [
        ("prefil=cuda:0", "LANE one of"),
        ("prefill", "LANE=DEVICE"),
        ("prefill=gpu0", "expected cpu, cuda:N or N"),
        ("prefill=0,prefill=1", "named twice"),
        ("", "at least one lane"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse_lane_devices(bad)


def test_placement_checks():
    two = {"prefill": "cuda:0", "verify": "cuda:1"}
    assert lane_devices_error({}, "colocated", 1, "self:2", cuda_count=0) is None
    assert lane_devices_error(two, "split", 1, "self:2", cuda_count=2) is None
    assert lane_devices_error(two, "split", 1, "self:2", cuda_count=1) == (
        "--lane-devices verify=cuda:1: this machine has cuda:0..cuda:0"
    )
    assert "no CUDA device" in (lane_devices_error(two, "split", 1, "none", cuda_count=0) or "")
    assert "--topology split" in (lane_devices_error(two, "colocated", 1, "none", cuda_count=2) or "")
    assert "--tensor-parallel" in (lane_devices_error(two, "split", 2, "none", cuda_count=4) or "")
    assert "colocated only" in (lane_devices_error(two, "split", 1, "eagle:/some/head", cuda_count=2) or "")
    assert lane_devices_error({"draft": "cpu"}, "split", 1, "ngram", cuda_count=0) is None


def test_each_lane_process_gets_its_device():
    options = EngineOptions(target="t", draft="self:2", device="cuda:0", lane_devices={"verify": "cuda:1"})
    devices = {}
    for lane in LANES:
        cmd = lane_command(lane, options, host="127.0.0.1")
        devices[lane] = cmd[cmd.index("--device") + 1]
    assert devices == {"prefill": "cuda:0", "draft": "cuda:0", "verify": "cuda:1"}


def test_serve_refuses_a_device_that_does_not_exist():
    """The real command line: one line naming the flag, exit 2, no model loaded."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "verifypd.cli", "serve", "--topology", "split", "--device", "cpu"]
        + ["--lane-devices", "prefill=cpu,verify=cuda:1", "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "verifypd: error: --lane-devices verify=cuda:1: this machine has no CUDA device"
    assert "Traceback" not in done.stderr


def test_each_lane_process_gets_the_share_of_its_gpu():
    """Pools are sized by the lanes placed on each GPU, not as if all three always shared one."""

    def shares(lane_devices):
        options = EngineOptions(target="t", draft="self:2", device="cuda:0", lane_devices=lane_devices)
        out = {}
        for lane in LANES:
            cmd = lane_command(lane, options, host="127.0.0.1")
            out[lane] = int(cmd[cmd.index("--device-lanes") + 1])
        return out

    assert shares({}) == {"prefill": 3, "draft": 3, "verify": 3}
    assert shares({"prefill": "cuda:0", "verify": "cuda:1", "draft": "cuda:1"}) == {
        "prefill": 1,
        "draft": 2,
        "verify": 2,
    }
    assert shares({"verify": "cuda:1"}) == {"prefill": 2, "draft": 2, "verify": 1}


def test_pool_blocks_take_the_lanes_share_of_free_memory(monkeypatch):
    import torch

    from verifypd.lanes.rpc.lane_setup import pool_blocks
    from verifypd.model.kv_pool import PoolGeometry

    geometry = PoolGeometry(2, 1, 16, 2, 64)
    per_block = geometry.bytes_per_block(torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (600 * per_block, 10**12))
    blocks = {
        n: pool_blocks(
            EngineOptions(target="t", device_lanes=n, gpu_memory_fraction=1.0),
            geometry,
            torch.device("cuda:1"),
            torch.bfloat16,
        )
        for n in (1, 2, 3)
    }
    assert blocks == {1: 600, 2: 300, 3: 200}


def test_lane_refuses_a_bad_device_share():
    done = subprocess.run(
        [sys.executable, "-m", "verifypd.cli", "lane", "verify", "--device-lanes", "0", "--allow-unauthenticated"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "verifypd: error: --device-lanes must be 1, 2 or 3; got 0"

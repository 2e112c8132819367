"""`serve --topology split --mps`: the lanes it starts run under a private CUDA MPS daemon
(lanes/mps.py). CPU only: a stand-in `nvidia-cuda-mps-control` on PATH records what it is asked
and with which environment; the lanes are not really spawned."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys

import pytest

from verifypd.engine import EngineOptions
from verifypd.lanes import mps
from verifypd.lanes.processes import LaneProcesses

FAKE_CONTROL = """#!/bin/sh
# stand-in for nvidia-cuda-mps-control: logs argv, stdin and the pipe directory
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(if [ -z "$*" ]; then cat; fi)" >> "{log}"
{fail}
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    def make(fail: bool = False) -> pathlib.Path:
        log = tmp_path / "control.log"
        script = tmp_path / "bin" / mps.CONTROL
        script.parent.mkdir(exist_ok=True)
        script.write_text(FAKE_CONTROL.format(log=log, fail='echo "no GPU" >&2; exit 1' if fail else ""))
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
        return log

    return make


def lanes_with_mps(mode: str, device: str, spawned: dict) -> LaneProcesses:
    """LaneProcesses whose lanes are not spawned: `spawned[lane]` gets the env each would have had."""
    procs = LaneProcesses(EngineOptions(target="t", draft="d", device=device), mps=mode)

    def spawn(lane, port=0):
        spawned[lane] = procs._env()
        procs.procs[lane] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        pathlib.Path(procs._files[lane]).write_text("1234\n")

    procs._spawn = spawn
    return procs


def test_lanes_get_a_private_daemon_that_is_quit_with_them(fake_control):
    log = fake_control()
    spawned: dict = {}
    procs = lanes_with_mps("on", "cuda", spawned)
    procs.start(timeout_s=5)
    pipe = spawned["verify"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(procs._dir)  # private: inside this launcher's directory, not /tmp/nvidia-mps
    assert all(env["CUDA_MPS_PIPE_DIRECTORY"] == pipe for env in spawned.values())
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # only the lanes' environment has it
    procs.terminate()
    lines = log.read_text().splitlines()
    assert lines[0] == f"args=-d pipe={pipe} stdin="
    assert lines[-1] == f"args= pipe={pipe} stdin=quit"
    assert not os.path.exists(procs._dir)


def test_auto_falls_back_to_time_slicing_and_on_refuses(fake_control, tmp_path):
    spawned: dict = {}
    procs = lanes_with_mps("auto", "cpu", spawned)  # CPU lanes: nothing to share
    procs.start(timeout_s=5)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in spawned["prefill"]
    procs.terminate()
    fake_control(fail=True)
    assert mps.start_for_lanes("auto", "cuda", str(tmp_path)) is None  # the daemon failed: logged, off
    with pytest.raises(mps.MpsUnavailable, match="no GPU"):
        mps.start_for_lanes("on", "cuda", str(tmp_path))
    with pytest.raises(mps.MpsUnavailable, match="needs CUDA"):
        mps.start_for_lanes("on", "cpu", str(tmp_path))
    assert mps.start_for_lanes("off", "cuda", str(tmp_path)) is None


@pytest.mark.slow
def test_serve_mps_on_without_split_cuda_lanes_exits_2():
    from verifypd.lanes.processes import child_env

    for extra in (["--topology", "colocated", "--device", "cuda"], ["--topology", "split", "--device", "cpu"]):
        done = subprocess.run(
            [sys.executable, "-m", "verifypd.cli", "serve", "--mps", "on", *extra, "--port", "0", "--http-port", "0"],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "--mps on" in done.stderr and "Traceback" not in done.stderr

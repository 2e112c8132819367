"""Spawning the three lane processes of `verifypd serve --topology split`.

Children are started with `sys.executable -m verifypd.cli lane ...` (spawn + exec: never a fork of
a process that already initialized torch/CUDA). Each binds port 0 and writes the port it got to a
file once it serves, so there is no port race. Children exit when this process goes away: they
watch their parent pid, and `terminate()` runs at exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import verifypd

log = logging.getLogger("verifypd.launcher")
LANES = ("prefill", "draft", "verify")


def lane_command(lane: str, options, *, host: str, port: int = 0, port_file: str | None = None,
                 parent_pid: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "verifypd.cli", "lane", lane, "--host", host, "--port", str(port),
           "--target", options.target, "--draft", options.draft, "--device", options.device,
           "--dtype", options.dtype, "--block-size", str(options.block_size)]
    if options.max_context is not None:
        cmd += ["--max-context", str(options.max_context)]
    if options.num_blocks is not None:
        cmd += ["--num-blocks", str(options.num_blocks)]
    if port_file:
        cmd += ["--port-file", port_file]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd


def child_env() -> dict[str, str]:
    """This process's env, with the directory holding the verifypd package on PYTHONPATH."""
    env = dict(os.environ)
    root = str(pathlib.Path(verifypd.__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
    return env


class LaneProcesses:
    def __init__(self, options, host: str = "127.0.0.1"):
        self.options, self.host = options, host
        self.procs: dict[str, subprocess.Popen] = {}
        self.addrs: dict[str, str] = {}
        # The owners' /dev/shm pool files: a lane killed by SIGKILL cannot remove its own.
        self.shm_paths: list[str] = []
        self._dir = tempfile.mkdtemp(prefix="verifypd-lanes-")
        atexit.register(self.terminate)

    def start(self, timeout_s: float = 300.0) -> dict[str, str]:
        env = child_env()
        files = {lane: os.path.join(self._dir, f"{lane}.port") for lane in LANES}
        for lane in LANES:
            cmd = lane_command(lane, self.options, host=self.host, port_file=files[lane], parent_pid=os.getpid())
            self.procs[lane] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
            log.info("started %s lane, pid %d", lane, self.procs[lane].pid)
        deadline = time.monotonic() + timeout_s
        while len(self.addrs) < len(LANES):
            for lane in LANES:
                if lane in self.addrs:
                    continue
                code = self.procs[lane].poll()
                if code is not None:
                    self.terminate()
                    raise RuntimeError(f"{lane} lane exited with code {code} while starting (see its log above)")
                if os.path.exists(files[lane]):
                    port = pathlib.Path(files[lane]).read_text().strip()
                    self.addrs[lane] = f"{self.host}:{port}"
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"lanes did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
        return dict(self.addrs)

    def pids(self) -> dict[str, int]:
        return {lane: p.pid for lane, p in self.procs.items()}

    def terminate(self, timeout_s: float = 5.0) -> None:
        # The prefill lane maps the owners' pools: it goes first (producers outlive consumers).
        for group in (("prefill",), ("draft", "verify")):
            procs = [self.procs[lane] for lane in group if lane in self.procs]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for path in self.shm_paths:
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self._dir, ignore_errors=True)

"""Spawning the three lane processes of `verifypd serve --topology split` (the engine core does,
verifypd.core.process), and `child_env`: the environment every verifypd process spawns its
children with (lanes, tensor-parallel ranks, the engine core).

Children are started with `sys.executable -m verifypd.cli lane ...` (spawn + exec: never a fork of
a process that already initialized torch/CUDA). Each binds port 0 and writes the port it got to a
file once it serves, so there is no port race; the lines after the port name the /dev/shm pool
files the lane owns, so they can be removed even after a SIGKILL. Children exit when this process
goes away: they watch their parent pid, and `terminate()` runs at exit.

The lane secret (net/auth.py) reaches the children through their environment. `restart(lane)`
starts a dead lane again on the same port (so the gateway's channel reconnects by itself); the
supervisor (supervisor.py) decides when.
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
import threading
import time

import verifypd
from verifypd.domain.options import EngineOptions
from verifypd.lanes.mps import MpsDaemon, start_for_lanes
from verifypd.net.auth import LANE_SECRET_ENV, new_secret

log = logging.getLogger("verifypd.launcher")
LANES = ("prefill", "draft", "verify")
AUTO_THREADS_ENV = "VERIFYPD_AUTO_THREADS"  # marks an OMP_NUM_THREADS that child_env chose


def device_lanes(options: EngineOptions, lane: str) -> int:
    """How many of the lane processes serve starts run on `lane`'s device (itself included): the
    share of that GPU's free memory its KV pool may take (lanes/rpc/lane_setup.pool_blocks)."""
    device = options.lane_devices.get(lane, options.device)
    return sum(options.lane_devices.get(other, options.device) == device for other in LANES)


def lane_command(
    lane: str,
    options: EngineOptions,
    *,
    host: str,
    port: int = 0,
    port_file: str | None = None,
    parent_pid: int | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "lane",
        lane,
        "--host",
        host,
        "--port",
        str(port),
        "--target",
        options.target,
        "--draft",
        options.draft,
        "--device",
        options.lane_devices.get(lane, options.device),  # --lane-devices: this lane's own GPU
        "--device-lanes",
        str(device_lanes(options, lane)),
        "--dtype",
        options.dtype,
        "--block-size",
        str(options.block_size),
    ]
    if options.quantization is not None:
        cmd += ["--quantization", options.quantization]
    if options.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", options.kv_cache_dtype]
    if options.max_context is not None:
        cmd += ["--max-context", str(options.max_context)]
    if options.num_blocks is not None:
        cmd += ["--num-blocks", str(options.num_blocks)]
    if options.graph_buckets:
        cmd += ["--graph-buckets", ",".join(map(str, options.graph_buckets))]
    if lane != "draft" and getattr(options, "tensor_parallel", 1) > 1:  # the lanes that run the target
        cmd += ["--tensor-parallel", str(options.tensor_parallel), "--tp-all-reduce", options.tp_all_reduce]
    if lane != "prefill":  # the owners capture graphs up to the router's longest draft
        cmd += ["--k-max", str(options.config.k_max)]
    if lane == "verify" and options.simulated_acceptance is not None:  # benchmark only
        cmd += ["--simulated-acceptance", repr(float(options.simulated_acceptance))]
    if port_file:
        cmd += ["--port-file", port_file]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd


def child_env(core_share: int | None = None) -> dict[str, str]:
    """This process's env, with the directory holding the verifypd package on PYTHONPATH.
    `core_share`: the child runs torch on 1/core_share of this machine's cores: OMP_NUM_THREADS (torch's
    intra-op threads) is set to that, at least 1, unless the user set it. Torch's default, one thread
    per core in every process, made all streams of a CPU server stall together whenever another job
    took a core (bench/serving/cpu_contention.py, docs/services.md "CPU threads")."""
    env = dict(os.environ)
    ours = env.get(AUTO_THREADS_ENV) == "1"  # set by a verifypd parent, not by the user: recomputed
    if core_share is not None and ("OMP_NUM_THREADS" not in env or ours):
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // core_share))
        env[AUTO_THREADS_ENV] = "1"
    root = str(pathlib.Path(verifypd.__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in paths if p != root]])
    return env


def read_port_file(path: str) -> tuple[str, list[str]]:
    """(port, shm pool paths) from a lane's port file."""
    lines = pathlib.Path(path).read_text().split()
    return lines[0], [ln for ln in lines[1:] if ln.startswith("/dev/shm/verifypd-")]


class LaneStartError(RuntimeError):
    """A lane exited while starting; `code` 2: it refused its arguments (serve exits 2 too)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class LaneProcesses:
    def __init__(
        self, options: EngineOptions, host: str = "127.0.0.1", secret: str | None = None, tls=None, mps: str = "off"
    ):
        """`tls`: a verifypd.net.lane_tls.LaneTls whose files every lane gets (mutual TLS)."""
        self.options, self.host, self.tls = options, host, tls
        self.mps_mode = mps  # --mps: a private MPS daemon for the lanes (mps.py); started by start()
        self.mps: MpsDaemon | None = None
        self.secret = secret or new_secret()  # one per `serve`; only our lanes and gateway know it
        self.procs: dict[str, subprocess.Popen] = {}
        self.addrs: dict[str, str] = {}
        # The owners' /dev/shm pool files: a lane killed by SIGKILL cannot remove its own.
        self.shm_paths: list[str] = []
        self.stopping = False
        self.lock = threading.RLock()  # restart vs terminate
        self._dir = tempfile.mkdtemp(prefix="verifypd-lanes-")
        self._files = {lane: os.path.join(self._dir, f"{lane}.port") for lane in LANES}
        atexit.register(self.terminate)

    def _env(self) -> dict[str, str]:
        env = child_env(core_share=6)  # three lanes, each a sixth of the cores: half left for the rest
        env[LANE_SECRET_ENV] = self.secret
        if self.mps is not None:
            env.update(self.mps.env())
        return env

    def _spawn(self, lane: str, port: int = 0) -> None:
        cmd = lane_command(
            lane, self.options, host=self.host, port=port, port_file=self._files[lane], parent_pid=os.getpid()
        )
        if self.tls is not None:
            cmd += self.tls.argv()
        self.procs[lane] = subprocess.Popen(cmd, env=self._env(), stdin=subprocess.DEVNULL)
        log.info("started %s lane, pid %d", lane, self.procs[lane].pid)

    def _remove_pool_files(self, lane: str) -> None:
        if os.path.exists(self._files[lane]):
            for path in read_port_file(self._files[lane])[1]:
                if os.path.exists(path):
                    os.unlink(path)
            os.unlink(self._files[lane])

    def restart(self, lane: str) -> int:
        """Starts a dead lane again on its port; removes the pool files it left. Returns its pid."""
        with self.lock:
            if self.stopping:
                raise RuntimeError("lanes are stopping")
            self._remove_pool_files(lane)
            port = int(self.addrs[lane].rsplit(":", 1)[1])
            self._spawn(lane, port)
            return self.procs[lane].pid

    def start(self, timeout_s: float = 300.0) -> dict[str, str]:
        files = self._files
        self.mps = start_for_lanes(self.mps_mode, self.options.device, self._dir)
        for lane in LANES:
            self._spawn(lane)
        deadline = time.monotonic() + timeout_s
        while len(self.addrs) < len(LANES):
            for lane in LANES:
                if lane in self.addrs:
                    continue
                code = self.procs[lane].poll()
                if code is not None:
                    self.terminate()
                    raise LaneStartError(
                        f"{lane} lane exited with code {code} while starting (see its log above)", code
                    )
                if os.path.exists(files[lane]):
                    port, _ = read_port_file(files[lane])
                    self.addrs[lane] = f"{self.host}:{port}"
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"lanes did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
        return dict(self.addrs)

    def pids(self) -> dict[str, int]:
        return {lane: p.pid for lane, p in self.procs.items()}

    def terminate(self, timeout_s: float = 5.0) -> None:
        with self.lock:
            self.stopping = True
            self._terminate(timeout_s)

    def _terminate(self, timeout_s: float) -> None:
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
        for lane in LANES:
            self._remove_pool_files(lane)
        for path in self.shm_paths:
            if os.path.exists(path):
                os.unlink(path)
        if self.mps is not None:  # after its clients (the lanes) are gone
            self.mps.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

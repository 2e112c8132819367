"""A private CUDA MPS control daemon for the lane processes of one `serve --topology split`.

Without MPS the lane processes' CUDA contexts time-slice the GPU: while the prefill lane computes
a new request's prompt beside the verify lane's decode step, only one of them runs at a time.
Under MPS they share one GPU context, so the prefill's matrix products run beside the decode
step's memory-bound kernels (docs/services.md "MPS").

The daemon is this `serve`'s own: its pipe and log directories live in the launcher's temporary
directory, only the lanes get them in their environment (no other process on the machine
connects to it), and `stop()` quits it with the lanes. Torch-free.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

log = logging.getLogger("verifypd.mps")
CONTROL = "nvidia-cuda-mps-control"
MODES = ("auto", "on", "off")


class MpsUnavailable(RuntimeError):
    """The daemon cannot run here (no CUDA device, no control binary, or it failed to start)."""


class MpsDaemon:
    def __init__(self, root: str):
        self.pipe_dir = os.path.join(root, "mps-pipe")
        self.log_dir = os.path.join(root, "mps-log")
        self.running = False

    def env(self) -> dict[str, str]:
        """What a lane's environment needs to connect to this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def _run(self, args: list[str], stdin: str | None = None, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CONTROL, *args],
            input=stdin,
            env={**os.environ, **self.env()},
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )

    def start(self, timeout_s: float = 10.0) -> None:
        if shutil.which(CONTROL) is None:
            raise MpsUnavailable(f"{CONTROL} is not on PATH")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            done = self._run(["-d"], timeout_s=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsUnavailable(f"{CONTROL} -d: {exc}") from None
        if done.returncode != 0:
            raise MpsUnavailable(f"{CONTROL} -d exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
        self.running = True
        deadline = time.monotonic() + timeout_s  # the daemon forks: wait until it answers
        while True:
            try:
                if self._run([], stdin="get_server_list\n", timeout_s=2.0).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise MpsUnavailable(f"the MPS control daemon did not answer within {timeout_s:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        try:
            self._run([], stdin="quit\n")
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not quit the MPS control daemon (%s): %s", self.pipe_dir, exc)


def start_for_lanes(mode: str, device: str, root: str) -> MpsDaemon | None:
    """`--mps` for split lanes on `device`: a started daemon, or None (off, CPU lanes, or `auto` where
    MPS cannot run: logged). `on` where it cannot run raises MpsUnavailable."""
    if mode not in MODES:
        raise ValueError(f"--mps must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "off":
        return None
    if not device.startswith("cuda"):
        if mode == "on":
            raise MpsUnavailable(f"--mps on needs CUDA lanes; the device is {device!r}")
        return None
    daemon = MpsDaemon(root)
    try:
        daemon.start()
    except MpsUnavailable as exc:
        if mode == "on":
            raise
        log.warning("MPS not used for the lanes (%s): they time-slice the GPU", exc)
        return None
    log.info("lanes run under a private MPS daemon (%s)", daemon.pipe_dir)
    return daemon

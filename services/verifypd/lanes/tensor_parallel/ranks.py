"""The rank processes of a tensor-parallel target (`--tensor-parallel N`): one process per rank.

Rank 0 is the lane: the process that builds the stack (the offline CLI, the engine core of
`verifypd serve`) owns the lane calls, the host layouts and the sampler. It starts ranks 1..N-1
(`python -m verifypd.lanes.tensor_parallel.follower`, spawn + exec, each with one end of a socketpair), and the
N processes join one torch.distributed group (NCCL on GPUs, rank r on cuda:(base + r); gloo on the
CPU), rendezvous through a file in a private temp dir. Every target forward of rank 0 goes through
`LeaderRunner`: it writes the call (tp_calls) to every follower's socket, then runs it itself; a
follower runs the same ModelRunner method on the same runs and discards the logits. Both sides
therefore issue the same collectives in the same order (rank 0 holds one lock from sending a call
to having issued its forward, so a prefill started on another thread cannot interleave with a
verify). On CUDA, rank 0's streams serialize these forwards on the device in issue order too
(the prefill lane waits for the verify stream and the verify stream for the current one).

Start-up, in the same order on every rank: init the group, one eager all-reduce (NCCL creates its
communicator lazily, which cannot happen inside a graph capture), load the rank's shard, agree on
the pool's num_blocks (the minimum of the ranks' budgets: block ids are shared), build the runner,
capture the target's CUDA graphs (same buckets, same order: the collectives inside them pair up).

Failures: a follower that exits while rank 0 runs (crash, OOM kill, SIGKILL) leaves rank 0 blocked
in a collective that can never complete, so rank 0's watchdog logs it and ends the whole process
with exit status 1 (`os._exit`: no thread can unblock NCCL). The gateway then ends the requests in
flight with UNAVAILABLE and `serve` exits 1; the offline CLI exits 1. A follower exits when rank 0
goes away (EOF on its socket, or its parent pid changes) and on any error of its own.

Pools: a follower builds its own (private, or shared for an importer: /dev/shm on the CPU, CUDA IPC
on GPUs) when rank 0 owns one (the co-located engine, the verify lane), and reports a shared one's
descriptor back (rank 0 lists them in its pool's `rank_shards`); a follower of an importing lane
(the prefill lane) opens the pool rank 0 hands it with IMPORT (tp_follower.py).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import torch

from verifypd.domain.models import ModelLoadError
from verifypd.lanes.processes import child_env
from verifypd.lanes.tensor_parallel import calls as tp_calls
from verifypd.model.runner import ModelRunner

if TYPE_CHECKING:
    from verifypd.model.kv_pool import KvPool
    from verifypd.model.llama import PagedLlama

log = logging.getLogger("verifypd.tp")
# Seconds a collective waits for a peer before failing (gloo; NCCL's watchdog uses it too). The
# ranks run the same forward, so a long wait means a rank is gone or stuck: fail, do not hang.
TIMEOUT_ENV = "VERIFYPD_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(base index + r) on GPUs, the CPU otherwise."""
    if base.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (base.index or 0) + rank)


def check_devices(base: torch.device, world: int, all_reduce: str = "auto") -> None:
    if world < 1:
        raise ModelLoadError(f"--tensor-parallel must be >= 1, got {world}")
    if all_reduce == "custom" and world > 1 and base.type != "cuda":
        raise ModelLoadError(f"--tp-all-reduce custom needs the ranks on CUDA devices, not {base.type}")
    if base.type == "cuda":
        first, visible = base.index or 0, torch.cuda.device_count()
        if first + world > visible:
            raise ModelLoadError(
                f"--tensor-parallel {world} needs GPUs cuda:{first}..cuda:{first + world - 1}, "
                f"but {visible} {'is' if visible == 1 else 'are'} visible"
            )


def init_group(rank: int, world: int, init_file: str, device: torch.device, all_reduce: str = "auto"):
    """Joins the ranks' process group, runs the eager warm-up collective and sets up the all-reduce
    that `all_reduce` (--tp-all-reduce) picks (all_reduce.py); returns the TpGroup."""
    import torch.distributed as dist

    from verifypd.lanes.tensor_parallel.all_reduce import choose_group
    from verifypd.model.tensor_parallel import TorchDistributedGroup

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s()),
    )
    group = TorchDistributedGroup()
    group.all_reduce(torch.zeros(1, device=device))  # creates the communicator before any capture
    return choose_group(group, device, all_reduce)


def agree_blocks(group, blocks: int, device: torch.device) -> int:
    """The minimum of every rank's pool budget (each rank calls this once, at the same point)."""
    t = torch.tensor([blocks], dtype=torch.int64, device=device)
    group.all_reduce_min(t)
    return int(t.item())


class LeaderRanks:
    """Rank 0's side: the follower processes, their control sockets, the group and the watchdog."""

    def __init__(self, world: int, base: torch.device, follower_options: dict):
        self.world, self.device = world, rank_device(base, 0)
        self.lock = threading.Lock()
        self.stopping = False
        self._seq = 0
        self._blocks: int | None = None
        self._pool: KvPool | None = None
        self._runner: LeaderRunner | None = None
        self._ready: list[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="verifypd-tp-")
        init_file = os.path.join(self._dir, "rendezvous")
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        for rank in range(1, world):
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            options = dict(
                follower_options,
                rank=rank,
                world=world,
                init_file=init_file,
                device=str(rank_device(base, rank)),
                parent_pid=os.getpid(),
            )
            cmd = [
                sys.executable,
                "-m",
                "verifypd.lanes.tensor_parallel.follower",
                "--control-fd",
                str(theirs.fileno()),
                "--options",
                json.dumps(options),
            ]
            self.procs.append(
                subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=child_env(), stdin=subprocess.DEVNULL)
            )
            theirs.close()
            self.socks.append(mine)
            log.info("tensor-parallel rank %d of %d: pid %d on %s", rank, world, self.procs[-1].pid, options["device"])
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        try:
            self.group = init_group(0, world, init_file, self.device, follower_options.get("tp_all_reduce", "auto"))
        except BaseException:  # e.g. --tp-all-reduce custom refused: stop the followers first (no watchdog exit)
            self.close()
            raise

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.stopping:
                    self.fatal(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
            if self.stopping:
                return
            time.sleep(0.1)

    def fatal(self, message: str) -> NoReturn:
        """A rank is gone: rank 0 cannot finish a collective with it, so the process ends (exit 1)."""
        log.error("%s; the target's ranks cannot continue: exiting (status 1)", message)
        print(f"verifypd: error: {message}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def forward_failed(self, exc: BaseException) -> NoReturn:
        """A forward raised on rank 0 (a collective whose peer is gone, or anything else): the ranks
        are out of step for good, so this is fatal too. Names the lost rank when one has exited."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a peer's exit is what usually breaks a collective
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    self.fatal(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
            time.sleep(0.05)
        self.fatal(f"a tensor-parallel forward failed on rank 0 ({type(exc).__name__}: {exc})")

    def send(self, call: tp_calls.Call) -> None:
        """Writes one call to every follower (the caller holds `lock`)."""
        self._seq += 1
        call.seq = self._seq
        data = tp_calls.encode(call)
        for rank, (sock, proc) in enumerate(zip(self.socks, self.procs), start=1):
            try:
                sock.sendall(data)
            except OSError as exc:
                self.fatal(f"tensor-parallel rank {rank} (pid {proc.pid}) is gone: its control socket failed ({exc})")

    # The followers build exactly one pool and one runner, so rank 0 does too: a second Engine over
    # the same Models (benches run one per configuration) reuses them instead of starting
    # collectives (block agreement, graph captures) that no follower would join.
    def agreed_blocks(self, blocks: int) -> int:
        if self._blocks is None:
            self._blocks = agree_blocks(self.group, blocks, self.device)
        return self._blocks

    def target_pool(self, make: Callable[[], KvPool]) -> KvPool:
        if self._pool is None:
            self._pool = make()
        return self._pool

    def runner(
        self,
        model: PagedLlama,
        pool: KvPool,
        graphs: bool | str | None = None,
        buckets: tuple[int, ...] | None = None,
    ) -> LeaderRunner:
        """The runner over `pool` (the same one again for the same pool; a new one after
        `import_pool` handed the followers another pool)."""
        if self._runner is None or self._runner.model is not model or self._runner.pool is not pool:
            self._runner = LeaderRunner(self, model, pool, graphs=graphs, buckets=buckets)
        elif self._runner.features is not model.features:
            # Its graphs write the feature pool it was built with (none: no features at all), and
            # capturing again would start collectives no follower joins.
            raise RuntimeError(
                "this tensor-parallel target's runner was built with another feature pool (an engine "
                "without the EAGLE head first?): over one rank set, build the feature draft's engine first"
            )
        return self._runner

    def wait_ready(self) -> list[bytes]:
        """Each follower's start-up answer, in rank order, once it is ready: its pool's serialized
        PoolDescriptor (a lane owning a shared pool) or b"". Call after this rank's own start-up
        collectives (block agreement, graph capture), which the followers take part in first."""
        with self.lock:
            if self._ready is None:
                self._ready = []
                for rank in range(1, self.world):
                    try:
                        self._ready.append(self._reply(rank))
                    except RuntimeError as exc:
                        self.fatal(
                            f"tensor-parallel rank {rank} (pid {self.procs[rank - 1].pid}) failed to start: {exc}"
                        )
            return self._ready

    def import_pool(self, descriptors: list[bytes]) -> None:
        """Has follower r open `descriptors[r - 1]` (a serialized PoolDescriptor) and build its runner
        over it; raises RuntimeError with the first follower's error."""
        with self.lock:
            for sock, payload in zip(self.socks, descriptors):
                self._seq += 1
                try:
                    sock.sendall(tp_calls.encode(tp_calls.Call(tp_calls.IMPORT, [], seq=self._seq, payload=payload)))
                except OSError as exc:
                    self.fatal(f"tensor-parallel follower: control socket failed ({exc})")
            errors = []
            for rank in range(1, self.world):
                try:
                    self._reply(rank)
                except RuntimeError as exc:
                    errors.append(f"rank {rank}: {exc}")
            if errors:
                raise RuntimeError("; ".join(errors))

    def _reply(self, rank: int) -> bytes:
        try:
            return tp_calls.receive_reply(self.socks[rank - 1])
        except (EOFError, OSError, ValueError) as exc:
            self.fatal(f"tensor-parallel rank {rank} (pid {self.procs[rank - 1].pid}) is gone: {exc}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Orderly stop: followers get STOP (or EOF) and exit; killed if they do not."""
        if self.stopping:
            return
        self.stopping = True
        # Not forever: a thread stuck inside a forward holds the lock (its followers are then killed).
        locked = self.lock.acquire(timeout=5.0)
        try:
            for sock in self.socks:
                if locked:
                    try:
                        sock.sendall(tp_calls.encode(tp_calls.Call(tp_calls.STOP, [])))
                    except OSError:
                        pass
                sock.close()
        finally:
            if locked:
                self.lock.release()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)


class LeaderRunner(ModelRunner):
    """Rank 0's target runner: each forward is first sent to the followers (module doc)."""

    def __init__(
        self,
        ranks: LeaderRanks,
        model: PagedLlama,
        pool: KvPool,
        graphs: bool | str | None = None,
        buckets: tuple[int, ...] | None = None,
    ):
        super().__init__(model, pool, graphs=graphs, buckets=buckets)
        self.ranks = ranks
        # The feature pool rank 0's forwards fill for an EAGLE head (model.features; None without one).
        # Only rank 0 has one: after each all-reduce the residual stream is whole and the same on
        # every rank, so the followers' forwards need none and the head runs whole here.
        self.features = model.features

    # Each call: under the lock, send, then issue the forward; any exception once the call was sent
    # is fatal (LeaderRanks.forward_failed): the followers have run or are running all of it.
    def forward(self, runs, logits_for):
        with self.ranks.lock:
            self.ranks.send(tp_calls.Call(tp_calls.FORWARD, runs, logits_for))
            try:
                return super().forward(runs, logits_for)
            except Exception as exc:
                self.ranks.forward_failed(exc)

    feeds_first_ids = False  # the followers would need the fed tokens too (not sent yet)
    verifies_greedy = False  # its followers run score(); the acceptance stays in the verify lane
    fits_verdict = False  # its followers would need the verdict too (engine.spec_ahead)

    def score(self, runs, device_ids=None):
        with self.ranks.lock:
            k = 0 if device_ids is None else int(device_ids.shape[1])
            self.ranks.send(tp_calls.Call(tp_calls.SCORE, runs, draft_k=k))
            try:
                if device_ids is not None:  # drafts that never visited the host: the followers need them too
                    device_ids = device_ids.to(torch.int64).contiguous()
                    self.ranks.group.broadcast(device_ids, 0)
                return super().score(runs, device_ids)
            except Exception as exc:
                self.ranks.forward_failed(exc)

    def last_logits(self, runs):
        with self.ranks.lock:
            self.ranks.send(tp_calls.Call(tp_calls.LAST_LOGITS, runs))
            try:
                return super().last_logits(runs)
            except Exception as exc:
                self.ranks.forward_failed(exc)

    def draft(self, runs, ks, samplings):
        raise RuntimeError("a tensor-parallel target does not draft (self-drafts are refused at load)")

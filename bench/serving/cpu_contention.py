"""Do in-flight requests stall together on a CPU server when other jobs use the cores?

`verifypd serve` (colocated, CPU, a tiny random Llama) with 8 closed-loop streaming clients for
`--seconds`, per configuration: torch intra-op threads of the engine core (`OMP_NUM_THREADS`, what
`verifypd serve` now sets by default on CPU, see docs/services.md "CPU threads") x contention (none, or
`--busy` busy-loop processes beside it). Reported per configuration: the gaps between consecutive
messages of a stream (p50 / p99 / max, ms), the longest moment when every stream waited at once, and
tokens/s. Random weights; the machine's load average is recorded (shared machines vary).

    python bench/serving/cpu_contention.py --out bench/results/cpu_contention_cpu.json
    python bench/serving/cpu_contention.py --smoke --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import grpc
from bench_meta import metadata
from chaos import write_tiny_model

from verifypd.v1 import generate_pb2, generate_pb2_grpc


def busy_loop() -> None:
    while True:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(target: str, threads: int | None, busy: int, seconds: float, clients: int) -> dict:
    port = free_port()
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "verifypd.cli", "serve", "--port", str(port), "--http-port", "0"]
    cmd += ["--target", target, "--draft", "ngram", "--device", "cpu", "--num-blocks", "512", "--max-context", "512"]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    ready = threading.Event()

    def read() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            if "verifypd: serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    hogs: list[multiprocessing.Process] = []
    try:
        if not ready.wait(600):
            raise RuntimeError("serve did not start")
        hogs = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(busy)]
        for h in hogs:
            h.start()
        stop = threading.Event()
        arrivals: list[list[float]] = [[] for _ in range(clients)]
        tokens = [0]
        lock = threading.Lock()

        def client(i: int) -> None:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            stub = generate_pb2_grpc.GenerationStub(channel)
            req = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5 + i, 6, 7, 8]), max_tokens=200, stop_at_eos=False
            )
            while not stop.is_set():
                for msg in stub.Generate(req, timeout=600):
                    arrivals[i].append(time.monotonic())
                    with lock:
                        tokens[0] += len(msg.token_ids)
            channel.close()

        workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for w in workers:
            w.start()
        time.sleep(3)  # warm-up
        t0, n0 = time.monotonic(), tokens[0]
        time.sleep(seconds)
        t1, n1 = time.monotonic(), tokens[0]
        stop.set()
        for w in workers:
            w.join(120)
        gaps = sorted(
            (b - a) * 1000 for arr in arrivals for a, b in zip(arr, arr[1:], strict=False) if t0 <= a and b <= t1
        )
        # Every stream waiting at once: the longest window in [t0, t1] in which no stream got a message.
        merged = sorted(t for arr in arrivals for t in arr if t0 <= t <= t1)
        all_wait = max((b - a for a, b in zip(merged, merged[1:], strict=False)), default=0.0) * 1000

        def pct(p: float) -> float:
            return round(gaps[min(len(gaps) - 1, int(p * len(gaps)))], 1) if gaps else 0.0

        return {
            "omp_num_threads": threads if threads is not None else "unset (the default of the serve under test)",
            "busy_processes": busy,
            "tok_per_s": round((n1 - n0) / (t1 - t0), 1),
            "gap_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": round(gaps[-1], 1) if gaps else 0.0},
            "all_streams_waited_ms_max": round(all_wait, 1),
            "load_average": os.getloadavg(),
        }
    finally:
        for h in hogs:
            h.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes in the contended configurations")
    ap.add_argument("--threads", default="unset,1", help="OMP_NUM_THREADS values of the engine core; 'unset'")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seconds, args.threads = 3.0, "1"
    target = write_tiny_model(pathlib.Path(tempfile.mkdtemp(prefix="verifypd-contention-")) / "target", seed=1)
    configs = []
    for busy in (0, args.busy):
        for t in args.threads.split(","):
            threads = None if t == "unset" else int(t)
            configs.append(run_config(target, threads, busy, args.seconds, args.clients))
            print(json.dumps(configs[-1]), file=sys.stderr, flush=True)
    result = {**metadata(), "model": "random weights (tiny Llama, 2 layers)", "cpu_count": os.cpu_count()}
    result["configs"] = configs
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

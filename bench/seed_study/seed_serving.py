"""One server of the seed-comparison sweep (bench/seed_study/seed_comparison.py) under load: `verifypd serve` as a
subprocess, its concurrency points driven over gRPC with the loadgen library, and GPU utilisation
sampled over NVML during each point."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "loadgen", "bench", "bench/seed_study"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from seed_rows import slug  # noqa: E402

# Shapes of verifypd.model.loader.RANDOM_SHAPES (random weights): `NAME` in a pair means `random:NAME`.
RANDOM_NAMES = ("tinyllama-1.1b", "llama-2-7b", "codellama-34b")


def model_spec(name: str) -> str:
    return f"random:{name}" if name in RANDOM_NAMES else name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- GPU


class Nvml:
    """GPU name, memory and a utilisation sampler over NVML (nvidia-ml-py); `error` says why not."""

    def __init__(self):
        self.handle, self.error = None, None
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(visible) if visible.isdigit() else 0
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except ImportError:
            self.error = "pynvml (package nvidia-ml-py) is not installed: GPU utilisation not recorded"
        except Exception as exc:  # no driver, no GPU
            self.error = f"NVML unavailable ({type(exc).__name__}: {exc}): GPU utilisation not recorded"

    def name(self) -> str | None:
        if self.handle is None:
            return None
        name = self.nvml.nvmlDeviceGetName(self.handle)
        return name.decode() if isinstance(name, bytes) else name

    def memory_gb(self) -> float | None:
        return None if self.handle is None else self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total / 1e9

    def utilisation(self) -> int:
        return self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu


class UtilSampler:
    """Samples GPU utilisation (%) every `interval` s in a background thread between start and stop."""

    def __init__(self, nvml: Nvml, interval: float = 0.1):
        self.nvml, self.interval = nvml, interval
        self.samples: list[int] = []
        self.stop_event = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.nvml.handle is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self):
        while not self.stop_event.is_set():
            try:
                self.samples.append(self.nvml.utilisation())
            except Exception:
                pass
            self.stop_event.wait(self.interval)

    def __exit__(self, *exc):
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(2)

    def result(self) -> dict:
        if not self.samples:
            return {"gpu_util_mean_pct": None, "gpu_util_max_pct": None, "gpu_util_samples": 0}
        return {
            "gpu_util_mean_pct": round(sum(self.samples) / len(self.samples), 1),
            "gpu_util_max_pct": max(self.samples),
            "gpu_util_samples": len(self.samples),
        }


def device_info(nvml: Nvml) -> tuple[str, str, float | None]:
    """(device name, file-name slug, GPU memory GB) from NVML, else nvidia-smi, else the CPU."""
    name, mem = nvml.name(), nvml.memory_gb()
    if name is None:
        try:
            out = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                text=True,
                stderr=subprocess.DEVNULL,
                timeout=20,
            ).splitlines()[0]
            name, mib = (p.strip() for p in out.split(",", 1))
            mem = float(mib) * 2**20 / 1e9
        except Exception:
            name, mem = "cpu", None
    known = re.search(r"\b(h100|h200|a100|l40s|a10g?|l4)\b", name.lower())
    return name, (known.group(1) if known else slug(name)), mem


# ----------------------------------------------------------------------------------------------- server


class ServeProcess:
    """`verifypd serve` as a subprocess: waits for its "serving" line, keeps the tail of its log."""

    READY = "verifypd: serving"

    def __init__(self, cmd: list[str], echo: bool = False, env: dict[str, str] | None = None):
        from verifypd.lanes.processes import child_env

        self.cmd = cmd
        self.lines: deque[str] = deque(maxlen=200)
        self.ready = threading.Event()
        self.address = None
        self.echo = echo
        self.proc = subprocess.Popen(
            cmd,
            env={**child_env(), **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.echo:
                sys.stderr.write("  [serve] " + line)
            if self.READY in line:
                m = re.search(r" on (\S+) \(", line)
                self.address = m.group(1) if m else None
                self.ready.set()
        self.ready.set()  # exited: wake the waiter

    def wait_ready(self, timeout: float) -> str | None:
        """None when ready; else the reason it is not."""
        if not self.ready.wait(timeout):
            return f"no '{self.READY}' line within {timeout:.0f} s"
        if self.address is None:
            self.proc.wait(10)
            return f"server exited with code {self.proc.returncode} while starting"
        return None

    def tail(self, n: int = 25) -> list[str]:
        return list(self.lines)[-n:]

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and any lanes it spawned
                self.proc.wait(10)
        self.reader.join(5)


def serve_command(args, pair: tuple[str, str], mode: str, port: int) -> list[str]:
    draft, target = pair
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
        model_spec(target),
        "--device",
        args.device,
        "--max-context",
        str(args.prompt_tokens + args.max_tokens + 64),
        "--max-running",
        str(max(256, max(args.concurrency))),
        "--max-queue",
        str(max(256, 2 * max(args.concurrency))),
        "--drain-timeout",
        "5",
    ]
    if mode == "k0":
        cmd += shlex.split(args.k0_args)
    else:
        cmd += ["--draft", model_spec(draft), "--simulated-acceptance", repr(args.alpha)]
        if args.schedule_flag:
            cmd += ["--schedule", mode]
    cmd += shlex.split(args.serve_args)
    cmd += shlex.split(args.mode_args.get(mode, ""))
    return cmd


# ----------------------------------------------------------------------------------------------- load


def workload(args, output_len: int):
    from verifypd_loadgen.workload import Distribution, Workload

    return Workload(
        input_len=Distribution("fixed", (args.prompt_tokens,)),
        output_len=Distribution("fixed", (output_len,)),
        vocab_range=args.vocab_range,
        seed=args.seed,
    )


def point_row(summary: dict, util: dict) -> dict:
    lat = summary["latency_ms"]
    spec = summary["speculation"]
    ks = {int(k): n for k, n in spec["applied_k"].items()}
    messages = sum(ks.values())
    req = summary["requests"]
    row = {
        "output_tok_s": round(summary["throughput"]["output_tokens_per_s"], 2),
        "e2e_mean_ms": _r(lat["e2e"]["mean"]),
        "e2e_p95_ms": _r(lat["e2e"]["p95"]),
        "e2e_p99_ms": _r(lat["e2e"]["p99"]),
        "ttft_p95_ms": _r(lat["ttft"]["p95"]),
        "itl_p95_ms": _r(lat["itl_token"]["p95"]),
        "acceptance_rate": None if spec["acceptance_rate"] is None else round(spec["acceptance_rate"], 4),
        "mean_applied_k": round(sum(k * n for k, n in ks.items()) / messages, 3) if messages else None,
        **util,
        "requests_completed": req["completed"],
        "requests_failed": req["failed"],
        "requests_cancelled": req["cancelled"],
        "errors": summary["errors"],
        "duration_s": round(summary["duration_s"], 2),
    }
    if req["completed"] == 0:
        row["status"] = "error"
        row["error"] = f"no request completed ({req['sent']} sent; errors {summary['errors']})"
    return row


def _r(v, digits: int = 2):
    return None if v is None else round(v, digits)


async def drive(args, address: str, base: dict, nvml: Nvml, on_row, alive, out_of_time) -> dict:
    """Warm-up, then every concurrency point against one server; calls on_row(row) per point."""
    import grpc

    from verifypd.v1 import generate_pb2, generate_pb2_grpc
    from verifypd_loadgen import metrics
    from verifypd_loadgen.runner import LoadPoint, Runner

    info = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            reply = await stub.GetServerInfo(generate_pb2.ServerInfoRequest(), timeout=30)
            info = {"target_model": reply.target_model, "draft_model": reply.draft_model, "topology": reply.topology}
        except grpc.aio.AioRpcError as exc:
            info = {"error": f"{exc.code().name}: {exc.details()}"}
        runner = Runner(stub, timeout=args.request_timeout, drain_timeout=args.request_timeout)
        if args.warmup_requests:
            c = min(args.warmup_requests, max(args.concurrency))
            await runner.run(
                LoadPoint("closed", concurrency=c),
                workload(args, min(32, args.max_tokens)).requests(stream=0),
                args.warmup_requests,
                None,
                "warmup",
                args.seed,
            )
        for c in args.concurrency:
            row = dict(base, concurrency=c, status="ok", error=None)
            if not alive():
                row.update(status="error", error="server is no longer running")
                on_row(row)
                continue
            if out_of_time():
                row.update(status="error", error=f"not run: --time-budget {args.time_budget:g} s spent")
                on_row(row)
                continue
            n = None if args.requests_per_point is None else max(args.requests_per_point, c)
            duration = None if n is not None else args.seconds_per_point
            try:
                with UtilSampler(nvml) as sampler:
                    res = await runner.run(
                        LoadPoint("closed", concurrency=c),
                        workload(args, args.max_tokens).requests(stream=1),
                        n,
                        duration,
                        f"c{c}",
                        args.seed,
                    )
                summary = metrics.summarize(res)
                row.update(point_row(summary, sampler.result()))
                row["summary"] = summary
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}")
            on_row(row)
    return info

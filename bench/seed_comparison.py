"""Serving sweep of the seed study's comparison (issue 14): schedules x concurrency through the real server.

For each (draft -> target pair, mode) this starts `verifypd serve` as a subprocess (random weights of the
named shapes, SIMULATED ACCEPTANCE alpha: real draft and verify compute, each draft token kept with
probability alpha), waits for its "serving" line, and drives it over gRPC Generate with the loadgen
library (verifypd_loadgen: Workload, Runner, metrics.summarize) at every concurrency. Modes:

  * k0        no speculation (`--draft none`): the floor every schedule is held against;
  * baseline | pd | pdv   `--schedule MODE` (speculative decoding; the study's three systems).

"Concurrency N" is a closed loop: N clients, each sending its next request the moment its previous one
ends (zero think time), so exactly N requests are in flight. Prompts are random token ids (random
weights have no tokenizer), every request generates exactly --max-tokens tokens (EOS ignored), greedy.

Per point: output tok/s, mean/P95/P99 end-to-end latency, TTFT P95, ITL P95 (per token), acceptance
rate, mean applied k (over the stream's token-bearing messages) and GPU utilisation (NVML, sampled every
100 ms in a background thread during the point; null where NVML is missing). A server that fails to
start, or a point that errors, is recorded with its error and the sweep goes on. The JSON is rewritten
after every point, so a run cut short keeps what it measured.

One pair per GPU call (a call is limited to 10 minutes), then merge:

    python bench/seed_comparison.py --pairs 'tinyllama-1.1b->llama-2-7b' --tag llama2 --out $OUT
    python bench/seed_comparison.py --pairs 'tinyllama-1.1b->tinyllama-1.1b' --tag tinyllama --out $OUT
    python bench/seed_comparison.py --report-only A.json B.json --out bench/results

Writes DIR/seed_comparison_<device>[_<tag>].json and .md (tables per pair, ratios vs k0 and vs pd, the
study's own figures beside ours, marked as theirs, and the PASS/MISS targets) and PNG plots.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for sub in ("services", "loadgen"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

DEFAULT_PAIRS = "tinyllama-1.1b->llama-2-7b,tinyllama-1.1b->tinyllama-1.1b,tinyllama-1.1b->codellama-34b"
DEFAULT_MODES = "k0,baseline,pd,pdv"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,96,128"
# Shapes of verifypd.model.loader.RANDOM_SHAPES (random weights): `NAME` in a pair means `random:NAME`.
RANDOM_NAMES = ("tinyllama-1.1b", "llama-2-7b", "codellama-34b")
# Targets that only fit a large GPU (bf16 weights + KV pools): GB of GPU memory needed.
MIN_GPU_GB = {"codellama-34b": 120}
LOAD_MODEL = ("closed loop: N clients, each sending its next request as soon as the previous one ends "
              "(zero think time), so N requests are in flight")
MODE_TITLES = {"k0": "k0 (no speculation)", "baseline": "Baseline", "pd": "PD", "pdv": "PDV"}

# The study's own figures: A100, real weights, their code. NOT measured here; shown beside ours only.
THEIRS = {
    "source": "the seed study (A100, real TinyLlama-1.1B -> Llama-2-7B weights, their code)",
    "pair": "tinyllama-1.1b->llama-2-7b",
    "peak_throughput": {"pd": (13.12, 16), "pdv": (12.75, 64)},   # tok/s at concurrency
    "p95_concurrency": (1, 5, 20, 50),
    "p95_ms": {"baseline": (6695, 33078, 113624, 361680), "pd": (6423, 33879, 123209, 368157),
               "pdv": (6341, 35639, 95711, 235652)},
}


# ----------------------------------------------------------------------------------------------- helpers

def git_revision() -> str:
    """VERIFYPD_GIT_REV wins: a copied tree's own git metadata can name another commit."""
    try:
        return os.environ.get("VERIFYPD_GIT_REV") or subprocess.check_output(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def model_spec(name: str) -> str:
    return f"random:{name}" if name in RANDOM_NAMES else name


def parse_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        draft, sep, target = item.partition("->")
        if not sep or not draft.strip() or not target.strip():
            raise argparse.ArgumentTypeError(f"pair {item!r}: expected DRAFT->TARGET")
        pairs.append((draft.strip(), target.strip()))
    return pairs


def pair_name(pair: tuple[str, str]) -> str:
    return f"{pair[0]}->{pair[1]}"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_").lower() or "x"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return {"gpu_util_mean_pct": round(sum(self.samples) / len(self.samples), 1),
                "gpu_util_max_pct": max(self.samples), "gpu_util_samples": len(self.samples)}


def device_info(nvml: Nvml) -> tuple[str, str, float | None]:
    """(device name, file-name slug, GPU memory GB) from NVML, else nvidia-smi, else the CPU."""
    name, mem = nvml.name(), nvml.memory_gb()
    if name is None:
        try:
            out = subprocess.check_output(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                          text=True, stderr=subprocess.DEVNULL, timeout=20).splitlines()[0]
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

    def __init__(self, cmd: list[str], echo: bool = False):
        from verifypd.server.launcher import child_env

        self.cmd = cmd
        self.lines: deque[str] = deque(maxlen=200)
        self.ready = threading.Event()
        self.address = None
        self.echo = echo
        self.proc = subprocess.Popen(cmd, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    cmd = [sys.executable, "-m", "verifypd.cli", "serve", "--port", str(port), "--http-port", "0",
           "--target", model_spec(target), "--device", args.device,
           "--max-context", str(args.prompt_tokens + args.max_tokens + 64),
           "--max-running", str(max(256, max(args.concurrency))), "--max-queue", str(max(256, 2 * max(args.concurrency))),
           "--drain-timeout", "5"]
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

    return Workload(input_len=Distribution("fixed", (args.prompt_tokens,)),
                    output_len=Distribution("fixed", (output_len,)), vocab_range=args.vocab_range, seed=args.seed)


def point_row(summary: dict, util: dict) -> dict:
    lat = summary["latency_ms"]
    spec = summary["speculation"]
    ks = {int(k): n for k, n in spec["applied_k"].items()}
    messages = sum(ks.values())
    req = summary["requests"]
    row = {"output_tok_s": round(summary["throughput"]["output_tokens_per_s"], 2),
           "e2e_mean_ms": _r(lat["e2e"]["mean"]), "e2e_p95_ms": _r(lat["e2e"]["p95"]),
           "e2e_p99_ms": _r(lat["e2e"]["p99"]), "ttft_p95_ms": _r(lat["ttft"]["p95"]),
           "itl_p95_ms": _r(lat["itl_token"]["p95"]),
           "acceptance_rate": None if spec["acceptance_rate"] is None else round(spec["acceptance_rate"], 4),
           "mean_applied_k": round(sum(k * n for k, n in ks.items()) / messages, 3) if messages else None,
           **util,
           "requests_completed": req["completed"], "requests_failed": req["failed"],
           "requests_cancelled": req["cancelled"], "errors": summary["errors"],
           "duration_s": round(summary["duration_s"], 2)}
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
            await runner.run(LoadPoint("closed", concurrency=c), workload(args, min(32, args.max_tokens)).requests(stream=0),
                             args.warmup_requests, None, "warmup", args.seed)
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
                    res = await runner.run(LoadPoint("closed", concurrency=c), workload(args, args.max_tokens).requests(stream=1),
                                           n, duration, f"c{c}", args.seed)
                summary = metrics.summarize(res)
                row.update(point_row(summary, sampler.result()))
                row["summary"] = summary
            except Exception as exc:  # noqa: BLE001 (recorded; the sweep goes on)
                row.update(status="error", error=f"{type(exc).__name__}: {exc}")
            on_row(row)
    return info


def run_sweep(args) -> dict:
    nvml = Nvml()
    device, device_slug, mem_gb = device_info(nvml)
    results = {"command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]), "device": device,
               "device_slug": device_slug, "gpu_memory_GB": None if mem_gb is None else round(mem_gb, 1),
               "git_revision": git_revision(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "nvml": "ok" if nvml.handle is not None else nvml.error,
               "weights": "random (shapes of the named models); no tokenizer: random token-id prompts",
               "label": f"simulated acceptance α={args.alpha:g}",
               "parameters": {"alpha": args.alpha, "modes": args.modes, "concurrency": args.concurrency,
                              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                              "seconds_per_point": None if args.requests_per_point else args.seconds_per_point,
                              "requests_per_point": args.requests_per_point, "warmup_requests": args.warmup_requests,
                              "sampling": "greedy, EOS ignored", "load": LOAD_MODEL, "schedule_flag": args.schedule_flag,
                              "serve_args": args.serve_args, "k0_args": args.k0_args, "mode_args": args.mode_args},
               "servers": [], "skipped": [], "rows": []}
    if nvml.handle is None:
        print(f"# {nvml.error}", file=sys.stderr)
    out = output_paths(args.out, device_slug, args.tag)
    save = lambda: write_json(results, out["json"])  # noqa: E731
    t_sweep = time.monotonic()
    out_of_time = lambda: args.time_budget is not None and time.monotonic() - t_sweep > args.time_budget  # noqa: E731
    for pair in args.pairs:
        need = MIN_GPU_GB.get(pair[1])
        if need and (mem_gb is None or mem_gb < need):
            note = (f"skipped: target {pair[1]} needs a GPU with >= {need} GB (an H200); this device "
                    f"({device}) has {'unknown' if mem_gb is None else f'{mem_gb:.0f} GB'}")
            results["skipped"].append({"pair": pair_name(pair), "note": note})
            print(f"# {pair_name(pair)}: {note}", flush=True)
            save()
            continue
        for mode in args.modes:
            base = {"pair": pair_name(pair), "draft": pair[0], "target": pair[1], "mode": mode,
                    "simulated_acceptance": None if mode == "k0" else args.alpha,
                    "label": "no speculation (k=0)" if mode == "k0" else f"simulated acceptance α={args.alpha:g}"}
            cmd = serve_command(args, pair, mode, free_port())
            entry = {"pair": pair_name(pair), "mode": mode, "command": " ".join(shlex.quote(c) for c in cmd)}
            if out_of_time():
                entry.update(status="error", error=f"not started: --time-budget {args.time_budget:g} s spent")
                results["servers"].append(entry)
                results["rows"] += [dict(base, concurrency=c, status="error", error=entry["error"])
                                    for c in args.concurrency]
                save()
                continue
            print(f"# {pair_name(pair)} {mode}: starting {entry['command']}", flush=True)
            t0 = time.monotonic()
            server = ServeProcess(cmd, echo=args.echo_server_logs)
            try:
                reason = server.wait_ready(args.startup_timeout)
                entry["startup_s"] = round(time.monotonic() - t0, 1)
                if reason is not None:
                    entry.update(status="error", error=reason, log_tail=server.tail())
                    print(f"# {pair_name(pair)} {mode}: {reason}\n  " + "\n  ".join(server.tail(12)), flush=True)
                    for c in args.concurrency:
                        results["rows"].append(dict(base, concurrency=c, status="error",
                                                    error=f"server failed to start: {reason}"))
                    continue

                def on_row(row):
                    results["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "summary"}), flush=True)
                    save()
                entry["server_info"] = asyncio.run(drive(args, server.address, base, nvml, on_row,
                                                         alive=lambda: server.proc.poll() is None,
                                                         out_of_time=out_of_time))
                entry["status"] = "ok" if server.proc.poll() is None else "error"
                if entry["status"] == "error":
                    entry.update(error=f"server exited with code {server.proc.returncode} during the sweep",
                                 log_tail=server.tail())
            except Exception as exc:  # noqa: BLE001
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}", log_tail=server.tail())
                done = {r["concurrency"] for r in results["rows"] if r["pair"] == base["pair"] and r["mode"] == mode}
                for c in args.concurrency:
                    if c not in done:
                        results["rows"].append(dict(base, concurrency=c, status="error", error=entry["error"]))
            finally:
                server.stop()
                entry["total_s"] = round(time.monotonic() - t0, 1)
                results["servers"].append(entry)
                save()
    results["sweep_seconds"] = round(time.monotonic() - t_sweep, 1)
    save()
    return results


# ----------------------------------------------------------------------------------------------- report

def output_paths(out_dir: str, device_slug: str, tag: str | None) -> dict[str, Path]:
    base = Path(out_dir) / ("seed_comparison_" + device_slug + (f"_{slug(tag)}" if tag else ""))
    return {"json": base.with_suffix(".json"), "md": base.with_suffix(".md"), "base": base}


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    from verifypd_loadgen.schema import _clean  # JSON has no inf/nan: written as strings

    tmp.write_text(json.dumps(_clean(results), indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


def merge(docs: list[dict]) -> dict:
    """One document from several partial runs (one per pair): rows, servers and skips concatenated;
    later files win for a repeated (pair, mode, concurrency)."""
    merged = {"sources": [{k: d.get(k) for k in ("command", "device", "git_revision", "date", "sweep_seconds")}
                          for d in docs],
              "device": " + ".join(sorted({d.get("device", "?") for d in docs})),
              "device_slug": "_".join(sorted({d.get("device_slug", "x") for d in docs})),
              "label": docs[0].get("label"), "parameters": docs[0].get("parameters"),
              "servers": [s for d in docs for s in d.get("servers", [])], "skipped": [], "rows": []}
    rows = {}
    for d in docs:
        for r in d.get("rows", []):
            rows[(r["pair"], r["mode"], r["concurrency"])] = r
    merged["rows"] = list(rows.values())
    measured = {r["pair"] for r in merged["rows"]}
    merged["skipped"] = [s for d in docs for s in d.get("skipped", []) if s["pair"] not in measured]
    return merged


def table_by(rows: list[dict], pair: str) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["pair"] == pair:
            out.setdefault(r["mode"], {})[r["concurrency"]] = r
    return out


def ok(row: dict | None, key: str):
    if not row or row.get("status") != "ok":
        return None
    return row.get(key)


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def check_targets(by_mode: dict[str, dict[int, dict]], concurrency: list[int]) -> list[dict]:
    """The issue's targets over one pair's rows: status PASS / MISS / N/A (no data) and the detail."""
    def tput(mode, c):
        return ok(by_mode.get(mode, {}).get(c), "output_tok_s")

    def p95(mode, c):
        return ok(by_mode.get(mode, {}).get(c), "e2e_p95_ms")

    checks = []

    def add(name, evaluated):
        misses = [d for good, d in evaluated if not good]
        status = "N/A" if not evaluated else ("MISS" if misses else "PASS")
        detail = (f"missed at {'; '.join(misses)}" if misses else f"held at {len(evaluated)} concurrency level(s)") \
            if evaluated else "no concurrency level with data for every mode involved"
        checks.append({"target": name, "status": status, "detail": detail})

    ev = []
    for c in (c for c in concurrency if c >= 8):
        v, d, b = tput("pdv", c), tput("pd", c), tput("baseline", c)
        if None not in (v, d, b):
            ev.append((v >= d >= b, f"c={c} (PDV {v:.1f}, PD {d:.1f}, Baseline {b:.1f} tok/s)"))
    add("PDV ≥ PD ≥ Baseline throughput at every concurrency ≥ 8", ev)
    ev = []
    for c in concurrency:
        v, d = p95("pdv", c), p95("pd", c)
        if None not in (v, d):
            ev.append((v <= d, f"c={c} (PDV {v:.0f} ms, PD {d:.0f} ms)"))
    add("PDV P95 latency ≤ PD P95 at every concurrency", ev)
    ev = []
    for c in concurrency:
        v, k = tput("pdv", c), tput("k0", c)
        if None not in (v, k):
            ev.append((v >= 0.97 * k, f"c={c} (PDV/k0 = {v / k:.3f})"))
    add("PDV throughput ≥ 0.97 × k0 at every concurrency", ev)
    ev = []
    v, k = tput("pdv", 1), tput("k0", 1)
    if None not in (v, k):
        ev.append((v >= 1.3 * k, f"c=1 (PDV/k0 = {v / k:.3f})"))
    add("PDV throughput ≥ 1.3 × k0 at concurrency 1", ev)
    return checks


def interpolate(points: dict[int, float], x: float) -> tuple[float | None, bool]:
    """(value at concurrency x, exact?) by linear interpolation between measured neighbours."""
    if x in points:
        return points[x], True
    lo = max((c for c in points if c < x), default=None)
    hi = min((c for c in points if c > x), default=None)
    if lo is None or hi is None:
        return None, False
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo), False


def mode_order(modes) -> list[str]:
    known = ["k0", "baseline", "pd", "pdv"]
    return [m for m in known if m in modes] + sorted(m for m in modes if m not in known)


def render_report(doc: dict, plots: dict[str, list[str]]) -> tuple[str, dict]:
    """Markdown report and the target checks per pair."""
    params = doc.get("parameters") or {}
    label = doc.get("label") or "simulated acceptance"
    lines = [f"# Seed-study comparison sweep — {doc.get('device')} — {label}", ""]
    lines += [f"**Every speculative row uses {label} (SIMULATED)**: random weights of the named shapes; real draft "
              f"and verify compute, each draft token kept with probability α (seeded Bernoulli), so acceptance "
              f"is the benchmark's choice, not the models'. k0 rows are plain decoding (no draft).", ""]
    srcs = doc.get("sources") or [{k: doc.get(k) for k in ("command", "device", "git_revision", "date", "sweep_seconds")}]
    for s in srcs:
        lines.append(f"- run: `{s.get('command')}` — {s.get('device')}, git {str(s.get('git_revision'))[:12]}, "
                     f"{s.get('date')}, {s.get('sweep_seconds')} s")
    lines += [f"- load: {params.get('load', LOAD_MODEL)}; prompt {params.get('prompt_tokens')} random token ids, "
              f"{params.get('max_tokens')} generated tokens per request ({params.get('sampling', 'greedy')}); "
              + (f"{params.get('requests_per_point')} requests per point" if params.get("requests_per_point")
                 else f"{params.get('seconds_per_point')} s per point (requests in flight then finish)")
              + "; served over gRPC Generate, measured with the loadgen library.",
              "- GPU utilisation: NVML, sampled every 100 ms during each point "
              + ("(null: NVML was not available)" if doc.get("nvml") not in (None, "ok") else "(mean / max %)."), ""]
    pairs = []
    for r in doc["rows"]:
        if r["pair"] not in pairs:
            pairs.append(r["pair"])
    checks_by_pair = {}
    for pair in pairs:
        by_mode = table_by(doc["rows"], pair)
        modes = mode_order(by_mode)
        cs = sorted({c for m in by_mode.values() for c in m})
        pair_label = pair.replace("->", " → ")
        lines += [f"## {pair_label} (draft → target) — {label}", ""]
        head = "| mode | " + " | ".join(f"c={c}" for c in cs) + " |"
        sep = "|---|" + "---|" * len(cs)

        def grid(title, key, digits=1, fn=None):
            nonlocal lines
            lines += [f"**{title}**", "", head, sep]
            for m in modes:
                vals = []
                for c in cs:
                    v = fn(m, c) if fn else ok(by_mode[m].get(c), key)
                    vals.append(fmt(v, digits))
                lines.append(f"| {MODE_TITLES.get(m, m)} | " + " | ".join(vals) + " |")
            lines.append("")

        tput = lambda m, c: ok(by_mode.get(m, {}).get(c), "output_tok_s")  # noqa: E731
        p95 = lambda m, c: ok(by_mode.get(m, {}).get(c), "e2e_p95_ms")  # noqa: E731
        grid("Output throughput (tok/s)", "output_tok_s")
        grid("P95 end-to-end latency (ms)", "e2e_p95_ms", 0)
        grid("Throughput ÷ k0", None, 2, lambda m, c: ratio(tput(m, c), tput("k0", c)))
        grid("Throughput ÷ PD", None, 2, lambda m, c: ratio(tput(m, c), tput("pd", c)))
        grid("P95 latency ÷ PD", None, 2, lambda m, c: ratio(p95(m, c), p95("pd", c)))
        lines += ["**Per point**", "",
                  "| mode | c | tok/s | E2E mean / P95 / P99 ms | TTFT P95 ms | ITL P95 ms | acceptance | mean k | GPU util % (mean/max) | ok/failed | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in modes:
            for c in cs:
                r = by_mode[m].get(c)
                if r is None:
                    continue
                if r.get("status") != "ok":
                    lines.append(f"| {m} | {c} | – | – | – | – | – | – | – | – | ERROR: {str(r.get('error'))[:160]} |")
                    continue
                acc = r.get("acceptance_rate")
                lines.append(
                    f"| {m} | {c} | {fmt(r['output_tok_s'])} | {fmt(r['e2e_mean_ms'], 0)} / {fmt(r['e2e_p95_ms'], 0)} / "
                    f"{fmt(r['e2e_p99_ms'], 0)} | {fmt(r['ttft_p95_ms'], 0)} | {fmt(r['itl_p95_ms'], 2)} | "
                    f"{'–' if acc is None else f'{acc:.3f}'} | {fmt(r.get('mean_applied_k'), 2)} | "
                    f"{fmt(r.get('gpu_util_mean_pct'))} / {fmt(r.get('gpu_util_max_pct'), 0)} | "
                    f"{r.get('requests_completed')}/{r.get('requests_failed')} | {r.get('label', '')} |")
        lines.append("")
        if pair == THEIRS["pair"]:
            lines += theirs_section(by_mode, modes)
        checks = check_targets(by_mode, cs)
        checks_by_pair[pair] = checks
        lines += [f"**Targets ({pair_label}, {label})**", ""]
        lines += [f"- **{c['status']}** — {c['target']}: {c['detail']}" for c in checks]
        lines.append("")
        for p in plots.get(pair, []):
            lines.append(f"![{Path(p).stem}]({Path(p).name})")
        lines.append("")
    for s in doc.get("skipped", []):
        lines += [f"## {s['pair'].replace('->', ' → ')} — skipped", "", s["note"], ""]
    failed = [s for s in doc.get("servers", []) if s.get("status") != "ok"]
    if failed:
        lines += ["## Server errors", ""]
        for s in failed:
            lines.append(f"- {s['pair']} {s['mode']}: {s.get('error')}")
            tail = s.get("log_tail") or []
            if tail:
                lines += ["", "  ```", *["  " + t for t in tail[-8:]], "  ```"]
        lines.append("")
    lines += ["## Targets summary", ""]
    for pair, checks in checks_by_pair.items():
        for c in checks:
            lines.append(f"- {c['status']}: {pair.replace('->', ' → ')} — {c['target']}")
    lines.append("")
    return "\n".join(lines), checks_by_pair


def theirs_section(by_mode, modes) -> list[str]:
    t = THEIRS
    out = [f"**The study's own figures — THEIRS: {t['source']}; not measured here, not comparable one-to-one "
           f"(different GPU, real weights and acceptance, their code)**", "",
           "| | theirs: peak tok/s (at c) | ours: peak tok/s (at c) |", "|---|---|---|"]
    for m in ("baseline", "pd", "pdv"):
        theirs = t["peak_throughput"].get(m)
        pts = {c: r["output_tok_s"] for c, r in by_mode.get(m, {}).items() if r.get("status") == "ok"}
        ours = max(pts.items(), key=lambda kv: kv[1]) if pts else None
        out.append(f"| {MODE_TITLES[m]} | {'–' if not theirs else f'{theirs[0]} (c={theirs[1]})'} | "
                   f"{'–' if not ours else f'{ours[1]:,.1f} (c={ours[0]})'} |")
    cs = t["p95_concurrency"]
    out += ["", "| P95 latency, ms | " + " | ".join(f"theirs c={c}" for c in cs) + " | "
            + " | ".join(f"ours c={c}" for c in cs) + " |", "|---|" + "---|" * (2 * len(cs))]
    approx = False
    for m in ("baseline", "pd", "pdv"):
        pts = {c: r["e2e_p95_ms"] for c, r in by_mode.get(m, {}).items() if r.get("status") == "ok"}
        ours = []
        for c in cs:
            v, exact = interpolate(pts, c)
            approx |= v is not None and not exact
            ours.append("–" if v is None else (f"{v:,.0f}" if exact else f"≈{v:,.0f}"))
        out.append(f"| {MODE_TITLES[m]} | " + " | ".join(f"{v:,}" for v in t["p95_ms"][m]) + " | " + " | ".join(ours) + " |")
    if approx:
        out += ["", "≈: our sweep did not run that concurrency; linear interpolation between the two measured "
                    "concurrencies around it."]
    out.append("")
    return out


def make_plots(doc: dict, base: Path) -> tuple[dict[str, list[str]], str | None]:
    """Per pair: throughput (loadgen's plot), P95 vs concurrency, and a mode-vs-mode heatmap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from verifypd_loadgen import plots as lg_plots
    except ImportError as exc:
        return {}, f"no plots: {exc}"
    label = doc.get("label") or ""
    written: dict[str, list[str]] = {}
    pairs = sorted({r["pair"] for r in doc["rows"]})
    for pair in pairs:
        by_mode = table_by(doc["rows"], pair)
        modes = mode_order(by_mode)
        stem = f"{base}_{slug(pair)}"
        paths = []
        series = []
        for m in modes:
            runs = [{"load": {"mode": "closed", "concurrency": c, "rate": None}, "summary": r["summary"]}
                    for c, r in sorted(by_mode[m].items()) if r.get("status") == "ok" and "summary" in r]
            if runs:
                series.append((MODE_TITLES.get(m, m), {"runs": runs}))
        if series:
            p = lg_plots.throughput_plot(series, Path(f"{stem}_throughput.png"))
            paths.append(str(p))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for m in modes:
            pts = sorted((c, r["e2e_p95_ms"]) for c, r in by_mode[m].items() if r.get("status") == "ok")
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=MODE_TITLES.get(m, m))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("P95 end-to-end latency (ms)")
        ax.set_title(f"{pair}: P95 latency — {label}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(f"{stem}_p95.png", dpi=110)
            paths.append(f"{stem}_p95.png")
        plt.close(fig)
        combos = [(a, b) for a, b in (("pdv", "pd"), ("pdv", "baseline"), ("pd", "baseline"), ("pdv", "k0"),
                                      ("pd", "k0"), ("baseline", "k0")) if a in by_mode and b in by_mode]
        cs = sorted({c for m in by_mode.values() for c in m})
        if combos and cs:
            grid = [[(ratio(ok(by_mode[a].get(c), "output_tok_s"), ok(by_mode[b].get(c), "output_tok_s")) or math.nan) - 1
                     for c in cs] for a, b in combos]
            fig, ax = plt.subplots(figsize=(3.5 + 0.75 * len(cs), 1.6 + 0.5 * len(combos)))
            im = ax.imshow([[v * 100 for v in row] for row in grid], cmap="RdYlGn", vmin=-50, vmax=50, aspect="auto")
            ax.set_xticks(range(len(cs)), [str(c) for c in cs])
            ax.set_yticks(range(len(combos)), [f"{MODE_TITLES.get(a, a)} vs {MODE_TITLES.get(b, b)}" for a, b in combos])
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, "–" if math.isnan(v) else f"{100 * v:+.0f}%", ha="center", va="center", fontsize=7)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{pair}: throughput improvement — {label}", fontsize=9)
            fig.colorbar(im, ax=ax, label="%")
            fig.tight_layout()
            fig.savefig(f"{stem}_heatmap.png", dpi=110)
            plt.close(fig)
            paths.append(f"{stem}_heatmap.png")
        written[pair] = paths
    return written, None


def write_report(doc: dict, out: dict[str, Path]) -> dict:
    out["md"].parent.mkdir(parents=True, exist_ok=True)
    plots, note = make_plots(doc, out["base"])
    text, checks = render_report(doc, plots)
    if note:
        text += f"\n({note})\n"
    out["md"].write_text(text)
    print(f"report: {out['md']}")
    for pair, cs in checks.items():
        for c in cs:
            print(f"{c['status']:4s}  {pair}: {c['target']} — {c['detail']}")
    return checks


# ----------------------------------------------------------------------------------------------- main

def int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be >= 1")
    return values


def mode_args(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        mode, sep, extra = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --mode-args {item!r}: expected MODE=ARGS")
        out[mode.strip()] = extra
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--pairs", type=parse_pairs, default=parse_pairs(DEFAULT_PAIRS),
                    help=f"DRAFT->TARGET,... (random shapes {', '.join(RANDOM_NAMES)} or model paths); default {DEFAULT_PAIRS}")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"k0 and `serve --schedule` values (default {DEFAULT_MODES})")
    ap.add_argument("--concurrency", type=int_list, default=int_list(DEFAULT_CONCURRENCY))
    ap.add_argument("--alpha", type=float, default=0.7, help="simulated acceptance of the speculative modes")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    per = ap.add_mutually_exclusive_group()
    per.add_argument("--seconds-per-point", type=float, default=6.0,
                     help="each point sends for this long, then lets in-flight requests finish (default 6)")
    per.add_argument("--requests-per-point", type=int, default=None, help="instead: this many requests (at least c)")
    ap.add_argument("--warmup-requests", type=int, default=32,
                    help="per server, before the first point: requests of up to 32 tokens (0 = none)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to start")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no server and no point after this (they are recorded as not run), so a "
                         "run under a hard time limit still ends with its JSON and report written")
    ap.add_argument("--device", default="auto", help="serve --device (default auto)")
    ap.add_argument("--vocab-range", default="100:31000", help="LO:HI of the random prompt token ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `verifypd serve` arguments for every server")
    ap.add_argument("--k0-args", default="--draft none", help="serve arguments of mode k0 (default: --draft none)")
    ap.add_argument("--mode-args", action="append", metavar="MODE=ARGS", help="extra serve arguments of one mode")
    ap.add_argument("--no-schedule-flag", dest="schedule_flag", action="store_false",
                    help="do not pass --schedule MODE (for servers without the flag: every mode runs serve's default)")
    ap.add_argument("--echo-server-logs", action="store_true")
    ap.add_argument("--tag", default=None, help="file-name suffix (e.g. one per pair, merged with --report-only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    ap.add_argument("--report-only", nargs="+", metavar="JSON", help="merge these runs' JSON into one report; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        docs = [json.loads(Path(p).read_text()) for p in args.report_only]
        doc = docs[0] if len(docs) == 1 else merge(docs)
        out = output_paths(args.out, doc.get("device_slug", "x"), args.tag)
        if len(docs) > 1:
            write_json(doc, out["json"])
            print(f"merged: {out['json']}")
        write_report(doc, out)
        return 0
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.mode_args = mode_args(args.mode_args)
    lo, _, hi = args.vocab_range.partition(":")
    args.vocab_range = (int(lo), int(hi))
    if not 0 <= args.alpha <= 1:
        ap.error("--alpha must be in [0, 1]")
    results = run_sweep(args)
    out = output_paths(args.out, results["device_slug"], args.tag)
    print(f"results: {out['json']}")
    write_report(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

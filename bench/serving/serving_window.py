"""The measured window of a serving point (bench/serving/serving_vs_engine.py): the served core's lane-call
and TTFT timers from /metrics, GPU busy share and processes' CPU seconds over exactly that window."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from seed_serving import UtilSampler


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (and its waited-for children), from /proc."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def percentile_ms(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1e3, 2)


HISTOGRAMS = {"verifypd_lane_step_duration_seconds": "verifypd_lane", "gen_ai_server_time_to_first_token_seconds": None}
# Steps launched ahead (engine.overlap), by whether they carried a prefill: "chained_prefill_<true|false>".
CHAINED = "verifypd_engine_chained_steps_total"


def scrape(http_port: int) -> dict[str, tuple[float, float]]:
    """From the served /metrics (the core's own timers): histogram -> (count, sum), the lane-call
    histogram per lane (its key the lane name), the core-side TTFT under "ttft"."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith(CHAINED + "{"):
            key = "chained_prefill_" + line.split('verifypd_step_prefill="', 1)[1].split('"', 1)[0]
            out[key] = [float(line.rsplit(" ", 1)[1]), 0.0]
            continue
        for name, label in HISTOGRAMS.items():
            for suffix, at in (("_count", 0), ("_sum", 1)):
                if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                    key = line.split(f'{label}="', 1)[1].split('"', 1)[0] if label else "ttft"
                    out.setdefault(key, [0.0, 0.0])[at] = float(line.rsplit(" ", 1)[1])
    return {key: (v[0], v[1]) for key, v in out.items()}


def window_rates(before: dict, after: dict, wall_s: float) -> dict:
    """Over the measured window, per lane: calls per second and mean milliseconds per call;
    `steps_per_s` = verify calls per second (one per decode step); `core_ttft_mean_ms`: the core's
    time to first token (arrival in the core to first token) of requests finished in the window;
    `chained_share`: of the verify calls, those launched ahead (engine.overlap), and
    `chained_prefill_share` those that also carried a prefill of admitted requests."""
    rates = {}
    chained = {key: after[key][0] - before.get(key, (0.0, 0.0))[0] for key in after if key.startswith("chained_")}
    verify_calls = after.get("verify", (0.0, 0.0))[0] - before.get("verify", (0.0, 0.0))[0]
    for key, (n1, s1) in after.items():
        if key.startswith("chained_"):
            continue
        n0, s0 = before.get(key, (0.0, 0.0))
        if n1 > n0:
            rates[key] = {"calls_per_s": round((n1 - n0) / wall_s, 1), "mean_ms": round((s1 - s0) / (n1 - n0) * 1e3, 3)}
    if "verify" in rates:
        rates["steps_per_s"] = rates["verify"]["calls_per_s"]
    ttft = rates.pop("ttft", None)
    rates["core_ttft_mean_ms"] = ttft["mean_ms"] if ttft else None
    if verify_calls > 0:
        rates["chained_share"] = round(sum(chained.values()) / verify_calls, 3)
        rates["chained_prefill_share"] = round(chained.get("chained_prefill_true", 0.0) / verify_calls, 3)
    return rates


class Window:
    """Reads the core's timers and samples the GPU over exactly the measured window: from
    `start_at + warmup` to `start_at + warmup + seconds` (wall clock), as the clients count tokens."""

    def __init__(self, args, http_port: int, nvml, start_at: float, pids: tuple = ()):
        self.args, self.http_port, self.nvml, self.pids = args, http_port, nvml, pids
        self.t_open, self.t_close = start_at + args.warmup, start_at + args.warmup + args.seconds
        self.before = self.after = {}
        self.util = None
        self.cpu = [0.0] * len(pids)  # CPU seconds of each of `pids` over the window
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        time.sleep(max(0.0, self.t_open - time.time()))
        self.before = scrape(self.http_port)
        cpu0 = [cpu_seconds(pid) for pid in self.pids]
        self.util = UtilSampler(self.nvml).__enter__()
        time.sleep(max(0.0, self.t_close - time.time()))
        self.util.__exit__()
        self.cpu = [cpu_seconds(pid) - c for pid, c in zip(self.pids, cpu0, strict=False)]
        self.after = scrape(self.http_port)

    def result(self) -> tuple[dict, float | None]:
        """(window_rates, GPU busy % mean over the window)."""
        self.thread.join(30)
        busy = self.util.result()["gpu_util_mean_pct"] if self.util is not None else None
        return window_rates(self.before, self.after, self.args.seconds), busy

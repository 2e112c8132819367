"""Chaos benchmark: `verifypd serve --topology split` under closed-loop load while lanes are killed,
stopped and resumed, idle connections flood its ports and malformed and oversized messages arrive.

    python bench/chaos.py --seconds 600 --out bench/results/chaos_cpu.json            # CPU, tiny random model
    python bench/chaos.py --smoke --out /tmp/chaos.json                               # ~1 minute
    python bench/chaos.py --target "$G" --draft self:12 --device cuda \\
        --serve-args "--no-adaptive --k-initial 3 --k-max 3" --concurrency 16 --control-seconds 30 \\
        --seconds 80 --fault-kinds kill,stop --fault-every 15 --lane-timeout 10 --stop-s 12 \\
        --recovery-timeout 120 --out chaos_gpu.json         # GPU, embedded model ($G: its GGUF), ~3.5 min

First a reference run: the request set (greedy and seeded-sampled, token-id prompts) once with no
fault, one request at a time. Then, with `--control-seconds`, that long of the same load with no
fault (the control: what batching alone changes), then `--seconds` of load (`--concurrency` clients
cycling through the set) with one fault every `--fault-every` seconds (`--no-faults`: none, a pure
control run), drawn at random (seeded) from `--fault-kinds`: SIGKILL a lane; SIGSTOP a lane for
`--stop-s` (longer than --lane-timeout: the supervisor must kill and restart it), then SIGCONT if it
still lives; `--flood` idle TCP connections on both public ports for 2 x --idle-timeout; 200 random
byte strings to Generate and to a lane; an oversized message to a lane without its secret and one to
the gateway. Every response is compared with the reference.

A response that differs from the reference is classified after the server has stopped
(bench/chaos_check.py): the target re-scores it in float32 alone (batch 1, no speculation); it is
"numerical" when every token from the first divergence on is the float32 choice or a near-tie of it
(within --tie-epsilon, default 2e-2 logits in bf16 / 1e-4 in float32, or --tie-ulps of the serving
dtype), else "wrong". Each differing output is listed with its first divergent position, the
reference's top-2 margin there, and the faults that acted while it was in flight.

Reported (JSON): requests sent / OK / lost (any non-OK end) / differ (OK but not the reference
tokens) / numerical / wrong, the same for the control phase, status counts (UNKNOWN / INTERNAL are
bugs), per fault the seconds until a new request completed again, the server tree's memory (PSS) and
open-fd high-water marks against the baseline before the first fault and after the last, the load
average. Targets: 0 lost, 0 wrong, recovery within the configured timeouts, memory back near the
baseline. The default model is random weights (labelled).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpc
from bench_meta import metadata
from chaos_check import DEFAULT_EPSILON, Completion, FaultWindow

from verifypd.v1 import generate_pb2, generate_pb2_grpc

VOCAB = 512
FAULT_KINDS = ("kill", "stop", "flood", "garbage", "oversized")
WORK_METHODS = {
    "prefill": "/verifypd.v1.PrefillLane/Prefill",
    "draft": "/verifypd.v1.DraftLane/Draft",
    "verify": "/verifypd.v1.VerifyLane/Verify",
}


def write_tiny_model(path: pathlib.Path, seed: int, noise: float = 0.0) -> str:
    """A 2-layer random Llama checkpoint with a word-level tokenizer (w3 .. w511), as transformers saves it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # well-separated greedy choices
        gen = torch.Generator().manual_seed(seed + 1)
        for param in model.parameters():
            if noise:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * noise)
    model.save_pretrained(path)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    ).save_pretrained(path)
    return str(path)


def requests_set(n: int, seed: int, max_tokens: int, shared_prefix: int = 0) -> list[generate_pb2.GenerateRequest]:
    """`shared_prefix` tokens common to every prompt (prefix-cache hits where caching is on; split serve
    turns it off today: the JSON's usage.cached_tokens shows whether any hit)."""
    rng = random.Random(seed)
    common = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        prompt = common + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))]
        sampling = (
            generate_pb2.SamplingParams(seed=1000 + i)
            if i % 2 == 0
            else generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i)
        )
        out.append(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=max_tokens, stop_at_eos=False, sampling=sampling
            )
        )
    return out


class ServerTree:
    """The serve process, its stderr lines, and its descendants' memory and descriptors."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "verifypd: serving" in line:
                self.ready.set()

    def lane_pids(self) -> dict[str, int]:
        pids: dict[str, int] = {}
        for ln in list(self.lines):
            m = re.search(r"verifypd: (\w+) lane pid=(\d+)", ln) or re.search(r"(\w+) lane restarted, pid (\d+)", ln)
            if m:
                pids[m.group(1)] = int(m.group(2))
        return pids

    def lane_addr(self, lane: str) -> str:
        for ln in self.lines:
            m = re.search(rf"verifypd: {lane} lane pid=\d+ addr=(\S+)", ln)
            if m:
                return m.group(1)
        raise RuntimeError(f"no address of the {lane} lane in the log")

    def pids(self) -> list[int]:
        """serve and all its descendants (by parent pid: a lane restarted by the supervisor thread is
        not in the main thread's /proc/PID/task/PID/children)."""
        parents: dict[int, int] = {}
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(stat.parent.name)] = int(fields[1])
        tree = [self.proc.pid]
        for pid in tree:  # grows while iterated: breadth-first
            tree += [child for child, parent in parents.items() if parent == pid]
        return tree

    def usage(self) -> tuple[float, int]:
        """(PSS MiB, open descriptors) summed over the tree. PSS, not RSS: the lanes map the same
        /dev/shm KV pools, which RSS would count once per process that touched them."""
        rss, fds = 0.0, 0
        for pid in self.pids():
            try:
                rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text()
                rss += int(re.search(r"Pss:\s+(\d+)", rollup).group(1)) / 1024  # type: ignore[union-attr]
                fds += len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, AttributeError):
                continue
        return rss, fds


def is_lane(pid: int) -> bool:
    try:
        return b"verifypd.cli\0lane" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def lane_secret(pid: int) -> str:
    env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"VERIFYPD_LANE_SECRET="))


class Load:
    """`concurrency` clients cycling through the request set; every result checked against the reference."""

    def __init__(self, address: str, reqs, reference: list[list[int]] | None, concurrency: int):
        self.address, self.reqs, self.reference = address, reqs, reference
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = self.ok = self.wrong = 0
        self.codes: dict[str, int] = {}
        self.lost: list[str] = []
        self.completions: list[Completion] = []  # each OK response
        self.usage = dict.fromkeys(("draft_tokens", "accepted_tokens", "cached_tokens", "prompt_tokens"), 0)
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]

    def _client(self, worker: int) -> None:
        channel = grpc.insecure_channel(self.address)
        stub = generate_pb2_grpc.GenerationStub(channel)
        n = worker
        while not self.stop.is_set():
            i = n % len(self.reqs)
            n += len(self.threads)
            code, ids, start, usage = "OK", [], time.monotonic(), None
            try:
                for msg in stub.Generate(self.reqs[i], timeout=600):
                    ids += msg.token_ids
                    usage = msg.usage if msg.HasField("usage") else usage
            except grpc.RpcError as exc:
                code = f"{exc.code().name}: {(exc.details() or '')[:120]}"
            with self.lock:
                self.sent += 1
                name = code.split(":")[0]
                self.codes[name] = self.codes.get(name, 0) + 1
                if code != "OK":
                    self.lost.append(f"request {i}: {code}")
                else:
                    self.ok += 1
                    self.completions.append(Completion(i, start, time.monotonic(), ids))
                    if usage is not None:  # counts "so far": the last message's are the request's
                        for field in self.usage:
                            self.usage[field] += getattr(usage, field)
                    if self.reference is not None and ids != self.reference[i]:
                        self.wrong += 1
        channel.close()


def reference_run(address: str, reqs) -> list[list[int]]:
    channel = grpc.insecure_channel(address)
    stub = generate_pb2_grpc.GenerationStub(channel)
    out = [[t for m in stub.Generate(r, timeout=600) for t in m.token_ids] for r in reqs]
    channel.close()
    return out


def raw_call(address: str, method: str, payload: bytes, metadata=(), timeout: float = 30) -> str:
    """Status of one call with raw request bytes (Generate is server-streaming: read it to the end)."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)])
    try:
        if method.endswith("/Generate"):
            for _ in channel.unary_stream(method, request_serializer=None)(payload, metadata=metadata, timeout=timeout):
                pass
        else:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
                payload, metadata=metadata, timeout=timeout
            )
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()


def inject_fault(args, rng: random.Random, server: ServerTree, address: str, port: int, http_port: int) -> dict:
    """One fault drawn from --fault-kinds; returns its record (the caller adds timing)."""
    kind = rng.choice(args.fault_kinds)
    lane = rng.choice(["prefill", "draft", "verify"])
    fault: dict = {"kind": kind}
    if kind == "kill":
        fault["lane"] = lane
        os.kill(server.lane_pids()[lane], signal.SIGKILL)
    elif kind == "stop":
        fault["lane"] = lane
        pid = server.lane_pids()[lane]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(args.stop_s)
        fault["killed_by_supervisor"] = not is_lane(pid)
        if is_lane(pid):
            os.kill(pid, signal.SIGCONT)
    elif kind == "flood":
        socks = []
        for p in (port, http_port):
            for _ in range(args.flood):
                s = socket.socket()
                s.settimeout(2)
                try:
                    s.connect(("127.0.0.1", p))
                    socks.append(s)
                except OSError:
                    s.close()
        fault["connections"] = len(socks)
        time.sleep(2 * args.idle_timeout)
        for s in socks:
            s.close()
    elif kind == "garbage":
        codes: dict[str, int] = {}
        lane_pid = server.lane_pids()["verify"]
        for i in range(200):
            payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            target = (
                (address, "/verifypd.v1.Generation/Generate", ())
                if i % 2 == 0
                else (
                    server.lane_addr("verify"),
                    "/verifypd.v1.VerifyLane/Verify",
                    (("x-verifypd-lane-secret", lane_secret(lane_pid)),) if is_lane(lane_pid) else (),
                )
            )
            code = raw_call(target[0], target[1], payload, target[2])
            codes[code] = codes.get(code, 0) + 1
        fault["codes"] = codes
    else:
        payload = b"\x0a" + b"\xff" * (args.oversized_mb << 20)
        fault["lane"] = lane
        fault["lane_unauthenticated"] = raw_call(server.lane_addr(lane), WORK_METHODS[lane], payload)
        fault["gateway"] = raw_call(address, "/verifypd.v1.Generation/Generate", payload[: 20 << 20])
    return fault


def run_phase(args, rng, server, address, ports, reqs, reference, seconds: float, faults_on: bool):
    """`seconds` of closed-loop load, with faults when `faults_on`: (load, fault records, fault windows)."""
    load = Load(address, reqs, reference, args.concurrency)
    for t in load.threads:
        t.start()
    faults: list[dict] = []
    windows: list[FaultWindow] = []
    t_start = time.monotonic()
    t_end = t_start + seconds
    while faults_on and time.monotonic() + args.fault_every < t_end:
        time.sleep(args.fault_every * rng.uniform(0.5, 1.0))
        at_s = round(time.monotonic() - t_start, 1)
        t0 = time.monotonic()
        fault = {**inject_fault(args, rng, server, address, *ports), "at_s": at_s}
        windows.append(FaultWindow(fault["kind"], fault.get("lane"), t0, time.monotonic()))
        # Recovered: a request that started after the fault began completed OK (the next fault waits
        # for that, so faults do not pile up on an unrecovered server).
        while time.monotonic() < t_end + 120 and not any(c.start >= t0 for c in list(load.completions)):
            time.sleep(0.1)
        done = [c.end for c in list(load.completions) if c.start >= t0]
        fault["recovered_after_s"] = round(min(done) - t0, 2) if done else None
        faults.append(fault)
        print(json.dumps(fault), file=sys.stderr, flush=True)
    time.sleep(max(0.0, t_end - time.monotonic()))
    load.stop.set()
    for t in load.threads:
        t.join(600)
    return load, faults, windows


def engine_counters(http_port: int) -> dict[str, float]:
    """Speculation and prefix-cache counters from the gateway's /metrics (they live in the engine core,
    so lane restarts do not reset them): shows the run did draft and did hit the cache."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    except OSError as exc:
        return {"error": str(exc)[:200]}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if not line.startswith("#") and re.search(
            r"spec_decode_num_(draft|accepted)_tokens|prefix_cache_\w*tokens", name
        ):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def phase_summary(load: Load) -> dict:
    return {
        # "wrong" until classify_phases explains some as numerical (every differing output otherwise)
        "requests": {
            "sent": load.sent,
            "ok": load.ok,
            "lost": len(load.lost),
            "differ": load.wrong,
            "wrong": load.wrong,
        },
        "status_counts": load.codes,
        "lost_examples": load.lost[:10],
        "usage": load.usage,  # summed over OK requests: did they draft, did they hit the prefix cache
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="~1 minute: 40 s of chaos, 2 faults of each kind at most")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--target", default=None, help="default: a tiny random Llama written to a temp dir")
    ap.add_argument("--draft", default=None, help="default: a noisy copy of the tiny target")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="serve --dtype")
    ap.add_argument("--serve-args", default="", help="more `verifypd serve` flags, e.g. '--no-adaptive --k-initial 4'")
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks per pool (fixed across restarts)")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens common to every prompt (prefix cache)")
    ap.add_argument("--no-faults", action="store_true", help="the same load with no fault: the control run")
    ap.add_argument(
        "--control-seconds", type=float, default=0.0, help="first this long with no fault (a control in the same run)"
    )
    ap.add_argument("--fault-kinds", default=",".join(FAULT_KINDS), help=f"comma-separated, of {FAULT_KINDS}")
    ap.add_argument("--fault-every", type=float, default=20.0)
    ap.add_argument("--lane-timeout", type=float, default=5.0)
    ap.add_argument("--recovery-timeout", type=float, default=60.0)
    ap.add_argument("--stop-s", type=float, default=12.0, help="how long a SIGSTOPped lane stays stopped")
    ap.add_argument("--flood", type=int, default=1500, help="idle connections per flood (both ports)")
    ap.add_argument("--idle-timeout", type=float, default=3.0)
    ap.add_argument("--oversized-mb", type=int, default=100)
    ap.add_argument("--tie-epsilon", type=float, default=None, help="default: 2e-2 (bf16, fp16), 1e-4 (float32)")
    ap.add_argument("--tie-ulps", type=float, default=2.0, help="tolerance also >= this many ulps of the top logit")
    ap.add_argument("--no-classify", action="store_true", help="skip the float32 re-scoring of differing outputs")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    args.fault_kinds = [k for k in args.fault_kinds.split(",") if k]
    if not args.fault_kinds or set(args.fault_kinds) - set(FAULT_KINDS):
        ap.error(f"--fault-kinds: each of {FAULT_KINDS}, got {args.fault_kinds}")
    if args.smoke:
        args.seconds, args.fault_every, args.flood, args.oversized_mb = 40.0, 6.0, 300, 20
    rng = random.Random(args.seed)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="verifypd-chaos-"))
    random_weights = args.target is None or args.target.startswith("random:")
    if args.target is None:
        args.target = write_tiny_model(tmp / "target", seed=1)
        args.draft = args.draft or write_tiny_model(tmp / "draft", seed=1, noise=0.2)
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--topology",
        "split",
        *("--port", str(port), "--http-port", str(http_port)),
        *("--target", args.target, "--draft", args.draft or "none", "--device", args.device, "--dtype", args.dtype),
        *("--lane-timeout", str(args.lane_timeout), "--recovery-timeout", str(args.recovery_timeout)),
        *("--idle-timeout", str(args.idle_timeout), "--max-lane-restarts", "50", "--drain-timeout", "5"),
    ]
    # A fixed pool: a restarted lane must own the geometry the router was built for (sized from free memory,
    # a restarted CUDA lane would see less free memory than the first one did).
    cmd += ["--num-blocks", str(args.num_blocks), "--max-context", "512", *shlex.split(args.serve_args)]
    env = dict(os.environ)
    server = ServerTree(cmd, env)
    address = f"127.0.0.1:{port}"
    result: dict = {**metadata(), "model": "random weights" if random_weights else args.target}
    phases: dict[str, tuple[Load, list[FaultWindow]]] = {}
    reqs = requests_set(args.requests, args.seed, args.max_tokens, args.shared_prefix)
    reference: list[list[int]] = []
    try:
        deadline = time.monotonic() + 900
        while not server.ready.wait(1.0):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start:\n" + "".join(server.lines[-30:]))
        reference = reference_run(address, reqs)
        reference_again = reference_run(address, reqs[:4])
        deterministic = reference_again == reference[:4]
        baseline_rss, baseline_fds = server.usage()
        peak = {"rss_mb": baseline_rss, "fds": baseline_fds}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                rss, fds = server.usage()
                peak["rss_mb"], peak["fds"] = max(peak["rss_mb"], rss), max(peak["fds"], fds)
                sampling.wait(0.5)

        threading.Thread(target=sample, daemon=True).start()
        ports = (port, http_port)
        if args.control_seconds > 0:
            load, _, _ = run_phase(args, rng, server, address, ports, reqs, reference, args.control_seconds, False)
            phases["control"] = (load, [])
            result["control"] = phase_summary(load)
        load, faults, windows = run_phase(
            args, rng, server, address, ports, reqs, reference, args.seconds, not args.no_faults
        )
        phases["no_faults" if args.no_faults else "chaos"] = (load, windows)
        settled = reference_run(address, reqs[:2]) == reference[:2]  # every lane serves again
        result["engine_counters"] = engine_counters(http_port)
        time.sleep(3)
        sampling.set()
        end_rss, end_fds = server.usage()
        log = "".join(server.lines)
        result.update(
            {
                "config": {k: v for k, v in vars(args).items() if k != "out"},
                "reference_deterministic": deterministic,
                "served_the_reference_after_the_chaos": settled,
                **phase_summary(load),
                "faults": faults,
                "recovery_s_max": max((f["recovered_after_s"] or 0) for f in faults) if faults else None,
                "memory_mb": {"baseline": round(baseline_rss), "peak": round(peak["rss_mb"]), "end": round(end_rss)},
                "fds": {"baseline": baseline_fds, "peak": peak["fds"], "end": end_fds},
                "log": {
                    "lines": len(server.lines),
                    "tracebacks": log.count("Traceback"),
                    "errors": sum(" ERROR " in ln for ln in server.lines),
                    "too_many_open_files": len(re.findall(r"Too many open files", log)),
                    "lane_restarts": len(re.findall(r"lane restarted, pid", log)),
                    "hung_kills": len(re.findall(r"does not answer: killing it", log)),
                    "recoveries": len(re.findall(r"lanes recovered after", log)),
                },
                "load_average": os.getloadavg(),
                "cpu_count": os.cpu_count(),
            }
        )
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                server.proc.kill()
        result["serve_exit_code"] = server.proc.returncode
        if phases and not args.no_classify:  # the server is gone: its GPU memory is free for the re-scoring
            result["classification"] = classify_phases(args, reqs, reference, phases)
            for name, summary in result["classification"]["phases"].items():
                target = result if name != "control" else result["control"]
                target["requests"].update({"numerical": summary["numerical"], "wrong": summary["wrong"]})
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print("wrote", args.out, file=sys.stderr)
    print(
        json.dumps(
            {k: result.get(k) for k in ("requests", "status_counts", "recovery_s_max", "memory_mb", "fds")}
            | {"control": result.get("control", {}).get("requests")}
        )
    )
    return 0


def classify_phases(args, reqs, reference: list[list[int]], phases: dict) -> dict:
    """Each phase's differing outputs, re-scored in float32 alone (chaos_check.py), and the reference's."""
    from chaos_check import Rescorer, check_reference, classify

    from verifypd.domain.convert import sampling_from_pb

    t0 = time.monotonic()
    rescorer = Rescorer(args.target, args.device, args.dtype, 512)
    epsilon = args.tie_epsilon if args.tie_epsilon is not None else DEFAULT_EPSILON[rescorer.serve_dtype]
    prompts = [list(r.token_ids.ids) for r in reqs]
    samplings = [sampling_from_pb(r.sampling) for r in reqs]
    out = {
        "rescoring": "target in float32 (weights rounded to the serving dtype first), batch 1, no speculation",
        "serve_dtype": str(rescorer.serve_dtype).removeprefix("torch."),
        "tie_epsilon": epsilon,
        "tie_ulps": args.tie_ulps,
        "reference_check": check_reference(rescorer, prompts, samplings, reference, epsilon, args.tie_ulps),
        "phases": {
            name: classify(rescorer, prompts, samplings, reference, load.completions, windows, epsilon, args.tie_ulps)
            for name, (load, windows) in phases.items()
        },
    }
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())

"""`--tensor-parallel` end to end on the CPU: `verifypd serve --device cpu --tensor-parallel 2`
(rank 0 in the engine core, one follower process, gloo) serves the tiny random Llama with a draft
model, and its greedy output equals the single-process engine's token for token (a crowd of
requests at once: ragged prefills, batched verify calls with device drafts broadcast to the
follower, prefill beside decode). A follower killed mid-stream ends the requests with UNAVAILABLE
and `serve` exits non-zero instead of hanging; flags that do not fit exit 2 naming the flag."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from services_helpers import (
    Client,
    Server,
    concurrent_greedy,
    engine_options,
    free_port,
    greedy_request,
    offline_outputs,
    random_prompts,
    serve_cmd,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # `verifypd serve` and lanes with tensor-parallel rank processes (tests/README.md)

FOLLOWER_LINE = re.compile(r"tensor-parallel rank 1 of 2: pid (\d+)")


def follower_pid(server: Server) -> int:
    return int(next(FOLLOWER_LINE.search(ln).group(1) for ln in server.lines if FOLLOWER_LINE.search(ln)))


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_tp2_serve_equals_single_process_greedy(tiny_models, topology):
    """split: the verify lane's two ranks own a /dev/shm pool each, the prefill lane's two ranks
    open them (rank_shards), so prefill KV written by both prefill ranks is what both verify ranks read."""
    prompts = random_prompts(10, seed=21, max_len=24)
    max_tokens = 20
    expected = offline_outputs(
        engine_options(*tiny_models, num_blocks=128),
        [
            RequestSpec(prompt_ids=tuple(p), max_tokens=max_tokens, stop_at_eos=False, sampling=SamplingParams())
            for p in prompts
        ],
    )
    port = free_port()
    server = Server(serve_cmd(tiny_models, port, "--tensor-parallel", "2", topology=topology), echo=False).wait_ready()
    try:
        followers = [ln for ln in server.lines if FOLLOWER_LINE.search(ln)]
        assert len(followers) == (2 if topology == "split" else 1), "".join(server.lines[-20:])
        client = Client(f"127.0.0.1:{port}")
        assert concurrent_greedy(client, prompts, max_tokens) == expected
        assert os.kill(follower_pid(server), 0) is None  # the follower served them (alive, not replaced)
        client.close()
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.lines[-20:])


def test_follower_crash_fails_requests_and_serve_exits(tiny_models):
    port = free_port()
    server = Server(serve_cmd(tiny_models, port, "--tensor-parallel", "2"), echo=False).wait_ready()
    try:
        pid = follower_pid(server)
        client = Client(f"127.0.0.1:{port}")
        outcomes: list = []
        started = threading.Event()

        def stream(prompt) -> None:
            try:
                for _ in client.gen.Generate(
                    generate_pb2.GenerateRequest(**greedy_request(prompt, max_tokens=230)), timeout=120
                ):
                    started.set()
                outcomes.append(("finished", ""))
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))

        readers = [threading.Thread(target=stream, args=(p,)) for p in random_prompts(6, seed=7, max_len=8)]
        for r in readers:
            r.start()
        assert started.wait(60)
        os.kill(pid, signal.SIGKILL)
        for r in readers:
            r.join(60)
        assert not any(r.is_alive() for r in readers), "a request hung after a tensor-parallel rank died"
        assert outcomes and all(code == grpc.StatusCode.UNAVAILABLE for code, _ in outcomes), outcomes
        assert server.proc.wait(30) == 1, "serve must exit non-zero when a rank of its target is gone"
        # The watchdog ("exited with code -9") or the next call's write ("is gone") notices first.
        assert any(f"verifypd: error: tensor-parallel rank 1 (pid {pid})" in ln for ln in server.lines), server.lines[
            -20:
        ]
        client.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def _cli_in_process(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """`verifypd ...` run through verifypd.cli.main in this process: (exit code, stderr). The same
    code as `python -m verifypd.cli` (its __main__ is sys.exit(main())) without a new interpreter
    loading torch and transformers (~5 s each on a 2-core CI machine); an exception escaping main
    (what would be a traceback) fails the test."""
    from verifypd import cli

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")  # main() sets it; undone at teardown
    capsys.readouterr()
    try:
        rc = cli.main(list(args))
    except SystemExit as exc:  # argparse's errors
        rc = exc.code
    return rc, capsys.readouterr().err


def test_bad_tensor_parallel_sizes_exit_2(tiny_models, capsys, monkeypatch):
    from verifypd.lanes.processes import child_env

    target, draft = tiny_models  # 4 heads, 2 kv heads, intermediate 128
    # `serve` refuses through its engine-core process (exit 2 passed up): real processes, both
    # topologies at once (each is mostly interpreter start-up and model loading).
    serves = {
        topology: subprocess.Popen(
            serve_cmd(tiny_models, free_port(), "--tensor-parallel", "4", topology=topology),
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for topology in ("colocated", "split")
    }
    try:
        common = ["generate", "--offline", "--raw", "hi", "--target", target, "--draft", draft, "--max-tokens", "2"]
        for extra, message in (
            (
                ["--device", "cpu", "--tensor-parallel", "4"],
                "--tensor-parallel 4: tensor parallel size 4 must divide num_kv_heads (2)",
            ),
            (["--device", "cpu", "--tensor-parallel", "0"], "--tensor-parallel: must be >= 1"),
            (
                ["--device", "cuda", "--tensor-parallel", "2"]
                if not _cuda_count()
                else ["--device", "cuda", "--tensor-parallel", str(_cuda_count() + 1)],
                "--tensor-parallel",
            ),
            (["--device", "cpu", "--tensor-parallel", "2", "--draft", "self:1"], "--tensor-parallel 2 splits"),
            (
                ["--device", "cpu", "--tensor-parallel", "2", "--tp-all-reduce", "custom"],
                "--tp-all-reduce custom needs the ranks on CUDA devices, not cpu",
            ),
            (
                ["--device", "cpu", "--tensor-parallel", "2", "--tp-all-reduce", "fast"],
                "--tp-all-reduce: invalid choice",
            ),
        ):
            rc, err = _cli_in_process(capsys, monkeypatch, *common, *extra)
            assert rc == 2 and message in err, (extra, rc, err[-600:])
            assert "Traceback" not in err
        for topology, proc in serves.items():
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 2 and "--tensor-parallel 4: tensor parallel size 4 must divide" in err, (
                topology,
                proc.returncode,
                err[-800:],
            )
            assert "Traceback" not in err, (topology, err[-800:])
    finally:
        for proc in serves.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_call_codec_round_trip_and_bad_headers():
    from verifypd.lanes.tensor_parallel import calls as tp_calls
    from verifypd.model.layout import TokenRun

    runs = [TokenRun([5, 6, 7], 0, (3, 4)), TokenRun([9], 41, (0, 1, 2, 8))]
    a, b = socket.socketpair()
    with a, b:
        a.sendall(tp_calls.encode(tp_calls.Call(tp_calls.SCORE, runs, draft_k=4, seq=7)))
        call = tp_calls.receive(b, TokenRun)
        assert (call.kind, call.runs, call.draft_k, call.seq, call.logits_for) == (tp_calls.SCORE, runs, 4, 7, None)
        a.sendall(tp_calls.encode(tp_calls.Call(tp_calls.FORWARD, runs[:1], "last")))
        assert tp_calls.receive(b, TokenRun).logits_for == "last"
        a.sendall(tp_calls.HEADER.pack(42, 0, 0, 0, 0, 0, 1, 0))
        with pytest.raises(ValueError, match="malformed"):
            tp_calls.receive(b, TokenRun)
        a.sendall(tp_calls.HEADER.pack(tp_calls.FORWARD, 0, 1, 2, 1, 0, 1, 0) + bytes(8 * 3 + 8 * 3))
        with pytest.raises(ValueError, match="do not add up"):  # lens say 0 tokens, header says 2
            tp_calls.receive(b, TokenRun)
        a.close()
        assert tp_calls.receive(b, TokenRun) is None  # EOF: rank 0 is gone


def _lane_followers(server: Server) -> dict[str, list[int]]:
    """Live follower pids by the lane they serve (their --options say: verify owns "shared" pools,
    prefill "import"s them)."""
    out: dict[str, list[int]] = {"verify": [], "prefill": []}
    for ln in list(server.lines):
        m = FOLLOWER_LINE.search(ln)
        if not m:
            continue
        try:
            with open(f"/proc/{m.group(1)}/cmdline", "rb") as f:
                cmd = f.read().decode()
        except OSError:
            continue  # exited
        out["verify" if '"pool": "shared"' in cmd else "prefill"].append(int(m.group(1)))
    return out


def test_split_tp2_recovers_from_lost_ranks(tiny_models):
    """The verify lane (rank 0) SIGKILLed, then a prefill lane's follower: each lane process exits and
    is restarted with new followers, the prefill ranks re-import the new verify ranks' pools, and
    every request still completes with the fault-free tokens."""
    prompts = random_prompts(16, seed=12, max_len=16)
    max_tokens = 20
    expected = offline_outputs(
        engine_options(*tiny_models, num_blocks=128),
        [
            RequestSpec(prompt_ids=tuple(p), max_tokens=max_tokens, stop_at_eos=False, sampling=SamplingParams())
            for p in prompts
        ],
    )
    port = free_port()
    server = Server(
        serve_cmd(
            tiny_models,
            port,
            "--tensor-parallel",
            "2",
            "--max-running",
            "4",
            "--recovery-timeout",
            "120",
            topology="split",
        ),
        echo=False,
    ).wait_ready()
    results: dict[int, tuple] = {}
    todo = list(enumerate(prompts))
    lock = threading.Lock()

    def worker() -> None:
        client = Client(f"127.0.0.1:{port}")
        while True:
            with lock:
                if not todo:
                    break
                n, prompt = todo.pop(0)
            try:
                results[n] = ("ok", client.generate(**greedy_request(prompt, max_tokens=max_tokens), timeout=300)[0])
            except grpc.RpcError as exc:
                results[n] = (exc.code(), exc.details())
        client.close()

    workers = [threading.Thread(target=worker) for _ in range(4)]
    try:
        first_prefill_follower = _lane_followers(server)["prefill"]
        assert len(first_prefill_follower) == 1, server.lines[-20:]
        for t in workers:
            t.start()
        assert _wait(lambda: len(results) >= 3, 120), "no progress"
        # After each kill: a recovery ended (at least one: the lane watchdog may add one for a healthy
        # lane whose health check was slow on a loaded machine; see Server.recovered_since).
        assert _wait(lambda: not server.recovering(), 180), server.lines[-20:]
        before = server.recoveries()
        os.kill(server.lane_pids()["verify"], signal.SIGKILL)
        assert _wait(lambda: server.count(r"lane restarted, pid") == 1, 180), server.lines[-20:]
        assert _wait(lambda: server.recovered_since(before), 180), server.lines[-20:]
        assert _wait(lambda: len(results) >= 8, 180), "no progress after the verify lane's restart"
        assert _wait(lambda: not server.recovering(), 180), server.lines[-20:]
        before = server.recoveries()
        os.kill(first_prefill_follower[0], signal.SIGKILL)
        assert _wait(lambda: server.count(r"lane restarted, pid") == 2, 180), server.lines[-20:]
        assert _wait(lambda: server.recovered_since(before), 180), server.lines[-20:]
        for t in workers:
            t.join(300)
        assert [results.get(n) for n in range(len(prompts))] == [("ok", e) for e in expected]
        assert sum("lane restarted, pid" in ln for ln in server.lines) == 2
    finally:
        server.stop()


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def _start_lanes(tiny_models, names, tmp_path) -> list[tuple[subprocess.Popen, str]]:
    """`verifypd lane NAME` processes, started together (each loads its models meanwhile); returns
    (process, address) per lane once every one has written its port file."""
    from verifypd.lanes.processes import child_env

    started = []
    for lane in names:
        port_file = tmp_path / f"{lane}.port"
        cmd = [
            sys.executable,
            "-m",
            "verifypd.cli",
            "lane",
            lane,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--call-port",
            "-1",
            "--allow-unauthenticated",
            "--target",
            tiny_models[0],
            "--draft",
            tiny_models[1],
            "--device",
            "cpu",
            "--num-blocks",
            "32",
            "--block-size",
            "4",
            "--max-context",
            "256",
            "--parent-pid",
            str(os.getpid()),
        ] + (["--tensor-parallel", "2"] if lane != "draft" else [])
        started.append(
            (subprocess.Popen(cmd, env=child_env(), stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port_file)
        )
    try:
        for (proc, port_file), lane in zip(started, names):
            assert (
                _wait(lambda port_file=port_file, proc=proc: port_file.exists() or proc.poll() is not None, 180)
                and proc.poll() is None
            ), lane
    except BaseException:
        for proc, _ in started:
            proc.kill()
        raise
    return [(proc, f"127.0.0.1:{port_file.read_text().split()[0]}") for proc, port_file in started]


def test_prefill_lane_checks_rank_shards(tiny_models, tmp_path):
    """ImportPools on a sharded prefill lane: the verify lane's rank shards are validated like its
    pool (a forged shm path is INVALID_ARGUMENT naming the field), their count must match the ranks,
    and copying sharded KV is refused; the untouched descriptors wire."""
    from verifypd.v1 import lanes_pb2, lanes_pb2_grpc

    lanes = _start_lanes(tiny_models, ("verify", "prefill", "draft"), tmp_path)
    try:
        verify, prefill, draft = (grpc.insecure_channel(addr) for _, addr in lanes)
        target = lanes_pb2_grpc.VerifyLaneStub(verify).Describe(lanes_pb2.LaneInfoRequest(), timeout=30).pools[0]
        draft_pool = lanes_pb2_grpc.DraftLaneStub(draft).Describe(lanes_pb2.LaneInfoRequest(), timeout=30).pools[0]
        assert len(target.rank_shards) == 1 and target.rank_shards[0].num_kv_heads == target.num_kv_heads == 1
        target.kv_transfer_addr, draft_pool.kv_transfer_addr = lanes[0][1], lanes[2][1]  # as wire_pools does
        stub = lanes_pb2_grpc.PrefillLaneStub(prefill)

        def import_pools(d, transport="auto"):
            return stub.ImportPools(
                lanes_pb2.ImportPoolsRequest(pools=[d, draft_pool], kv_transport=transport), timeout=60
            )

        # A file of the test's own: were the check missing, the follower would map it (torch.from_file
        # grows it to the pool's size and writes into it), so never point this at a real file.
        bait = tmp_path / "not-a-pool"
        bait.write_bytes(b"keep me")
        forged = lanes_pb2.PoolDescriptor.FromString(target.SerializeToString())
        forged.rank_shards[0].shm_path = str(bait)
        none = lanes_pb2.PoolDescriptor.FromString(target.SerializeToString())
        del none.rank_shards[:]
        for d, transport, code, words in (
            (forged, "auto", grpc.StatusCode.INVALID_ARGUMENT, "pools[target].rank_shards[0].shm_path"),
            (none, "auto", grpc.StatusCode.FAILED_PRECONDITION, "has 0 rank shards"),
            (target, "copy", grpc.StatusCode.FAILED_PRECONDITION, "copying sharded KV is not supported"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                import_pools(d, transport)
            assert err.value.code() == code and words in err.value.details(), err.value.details()
        assert bait.read_bytes() == b"keep me"  # refused before any rank opened it
        assert import_pools(target).mode_by_pool[target.pool_id] == "imported"
        for channel in (verify, prefill, draft):
            channel.close()
    finally:
        for proc, _ in lanes:
            proc.terminate()
            proc.wait(30)

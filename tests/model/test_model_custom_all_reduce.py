"""The custom all-reduce (model/custom_all_reduce.py, model/kernels/all_reduce.py) without GPUs: the
real Triton kernel runs under Triton's interpreter in 2 and 3 processes whose buffers are shared
memory, mapped at each process's own addresses (as CUDA IPC maps a peer's buffer on a GPU). Each
process signals and polls the peers' words in that memory exactly as on GPUs, so these tests check
the sums, the paths and the protocol: a rank that starts late (it sleeps first) must be waited for,
and back-to-back calls of mixed sizes and paths must not read a slot a peer is still writing.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

# Processes spawned; the paths and errors below run in this process (tests/README.md).
MAX_BYTES, ONE_SHOT_MAX, PROGRAMS, BLOCK = 4096, 1024, 3, 64
# (elements, dtype): one-shot, two-shot (chunks owned by both ranks, a ragged tail), the NCCL
# stand-in (gloo) above MAX_BYTES, then one-shot again right after (slot parity, round counts).
CALLS = [
    (100, torch.float32),
    (700, torch.float32),
    (1000, torch.bfloat16),
    (5, torch.float16),
    (3000, torch.float32),
    (300, torch.float32),
    (256, torch.float32),
]


def inputs(call: int, rank: int) -> torch.Tensor:
    n, dtype = CALLS[call]
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * call + rank)).to(dtype)


def custom_group(rank: int, world: int, buffers: list[torch.Tensor]):
    """This rank's CustomAllReduce over the shared buffers (gloo as the NCCL stand-in)."""
    from verifypd.model.custom_all_reduce import CustomAllReduce
    from verifypd.model.tensor_parallel import TorchDistributedGroup

    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)  # this process's mappings
    return CustomAllReduce(
        TorchDistributedGroup(),
        bases,
        rank,
        world,
        max_bytes=MAX_BYTES,
        one_shot_max_bytes=ONE_SHOT_MAX,
        programs=PROGRAMS,
        block=BLOCK,
        keep=tuple(buffers),
    )


def shared_buffers(world: int) -> list[torch.Tensor]:
    from verifypd.model.custom_all_reduce import buffer_bytes

    return [
        torch.zeros(buffer_bytes(PROGRAMS, world, MAX_BYTES), dtype=torch.uint8).share_memory_() for _ in range(world)
    ]


def rank_main(rank: int, world: int, buffers: list[torch.Tensor], init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = custom_group(rank, world, buffers)
        results = []
        for call in range(len(CALLS)):
            x = inputs(call, rank)
            if rank == (call % world):  # one rank arrives late each call: the others must wait for it
                time.sleep(0.3)
            path = group.path(x)
            group.all_reduce(x)
            results.append((path, x))
        torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")  # a local test artifact
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sum_over_shared_buffers(world, tmp_path):
    import torch.multiprocessing as mp

    buffers = shared_buffers(world)
    mp.spawn(rank_main, args=(world, buffers, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    paths = [path for path, _ in ranks[0]]
    assert paths == ["one-shot", "two-shot", "two-shot", "one-shot", "fallback", "two-shot", "one-shot"]
    for call, (n, dtype) in enumerate(CALLS):
        # The kernel sums in float32 in rank order, then rounds once (the interpreter's bfloat16
        # rounding may differ from torch's by one unit in the last place).
        expected = sum(inputs(call, r).float() for r in range(world)).to(dtype)
        tol = dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
        if paths[call] == "fallback":
            tol = dict(rtol=1e-6, atol=1e-6)  # gloo's own order
        for rank in range(world):
            got = ranks[rank][call][1]
            assert got.shape == (n,) and got.dtype == dtype
            torch.testing.assert_close(got, expected, **tol, msg=lambda m, c=call, r=rank: f"call {c} rank {r}: {m}")
            assert torch.equal(got, ranks[0][call][1]), f"call {call}: rank {rank} differs from rank 0"


def forward_rank(rank: int, buffers: list[torch.Tensor], init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from test_model_tensor_parallel import run_model
    from triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = custom_group(rank, 2, buffers)
        result = run_model(model_dir, group)
        result["calls"] = int(group.state[0, 1])  # the kernel's calls (program 0 counts every one)
        torch.save(result, pathlib.Path(out_dir) / f"rank{rank}.pt")  # a local test artifact
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_forward_over_the_kernel_equals_tp1(tmp_path):
    """The sharded tiny Llama with the custom all-reduce as its group (one-shot for decode rows,
    two-shot and the fallback for the prefill) gives the unsharded model's logits and tokens."""
    import torch.multiprocessing as mp
    from engine_helpers import write_tiny_llama
    from test_model_tensor_parallel import run_model

    from verifypd.model.tensor_parallel import SingleRank

    model_dir = str(write_tiny_llama(tmp_path / "llama", seed=3, layers=2, heads=4, kv_heads=2))
    buffers = shared_buffers(2)
    mp.spawn(forward_rank, args=(buffers, str(tmp_path / "rendezvous"), model_dir, str(tmp_path)), nprocs=2, join=True)
    single = run_model(model_dir, SingleRank())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["calls"] > 0  # the kernel ran (not only the fallback)
        for phase in ("prefill", "decode", "verify"):
            torch.testing.assert_close(result[phase], single[phase], rtol=1e-5, atol=1e-5)
        assert result["tokens"] == single["tokens"]


def make_group(world: int = 2, **kw):
    from verifypd.model.custom_all_reduce import CustomAllReduce

    return CustomAllReduce(None, torch.zeros(world, dtype=torch.int64), 0, world, **kw)


def test_path_by_size_dtype_and_layout():
    group = make_group(max_bytes=4096, one_shot_max_bytes=1024)
    assert group.path(torch.zeros(256)) == "one-shot"  # 1024 bytes
    assert group.path(torch.zeros(257)) == "two-shot"
    assert group.path(torch.zeros(2048, dtype=torch.bfloat16)) == "two-shot"  # 4096 bytes
    assert group.path(torch.zeros(1025)) == "fallback"  # over the slot
    assert group.path(torch.zeros(0)) == "fallback"
    assert group.path(torch.zeros(8, dtype=torch.int32)) == "fallback"
    assert group.path(torch.zeros(8, 8).t()) == "fallback"  # not contiguous
    assert group.path(torch.zeros(16, dtype=torch.float16)[1:]) == "fallback"  # not 16-byte aligned


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2..8 ranks"):
        make_group(world=1)
    with pytest.raises(ValueError, match="2..8 ranks"):
        make_group(world=9)
    with pytest.raises(ValueError, match="multiple of 256"):
        make_group(max_bytes=1000)


COMPILE_SM90 = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verifypd.model.kernels.all_reduce import _all_reduce_kernel as fn
out = {}
for dt in ("bf16", "fp32"):
    for two in (False, True):
        for world in (2, 8):
            sig = dict(data_ptr="*" + dt, n="i32", bases_ptr="*i64", state_ptr="*i64", rank="i32", sig_bytes="i32",
                       data_bytes="i32", WORLD="constexpr", WPAD="constexpr", BLOCK="constexpr", TWO_SHOT="constexpr")
            consts = dict(WORLD=world, WPAD=triton.next_power_of_2(world), BLOCK=2048, TWO_SHOT=two)
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # as the launch specializes them
            src = ASTSource(fn, sig, constexprs=consts, attrs=aligned)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
            out[f"{dt} two_shot={two} world={world}"] = ptx
print(json.dumps(out))
"""


def test_kernel_compiles_for_hopper_without_multicast():
    """The kernel as the GPU compiles it (sm_90 PTX, no GPU needed; the interpreter above skips the
    compiler): no multimem / multicast instruction (NVLink multicast must stay off), the signals are
    system-scope release stores and acquire polls, and the data moves in 16-byte vectors."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, ptx in json.loads(proc.stdout).items():
        assert "multimem" not in ptx and "multicast" not in ptx, name
        assert "atom.global.sys.release.exch.b64" in ptx, name
        assert "ld.global.sys.acquire.b64" in ptx, name  # the polls (an atomic add of 0 becomes a load)
        assert "bar.sync" in ptx, name
        scalar = "ld.global.b16" if name.startswith("bf16") else "ld.global.b32 "
        assert "ld.global.v4" in ptx and scalar not in ptx, f"{name}: data not moved in 16-byte vectors"

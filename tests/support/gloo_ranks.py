"""Runs a function on every rank of a CPU (gloo) process group and gathers each rank's results, for
the tensor-parallel model tests."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import torch


def _rank_main(rank: int, world: int, run: Callable, items: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    from verifypd.model.tensor_parallel import TorchDistributedGroup

    torch.set_num_threads(1)
    init = f"file://{pathlib.Path(out_dir) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {item: run(item, TorchDistributedGroup()) for item in items}
        torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")  # a local test artifact
    finally:
        dist.destroy_process_group()


def run_on_ranks(run: Callable[[str, Any], Any], items: list[str], out_dir: pathlib.Path, world: int) -> list[dict]:
    """[{item: run(item, group)} of each rank]: `world` processes, one gloo group; `run` must be a
    module-level function (the processes are spawned)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, run, items, str(out_dir)), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]

"""n samples of one prompt (HTTP `n` / `best_of`, gRPC `GenerateRequest.n`): submitting them so they
share the prompt's KV, and reading their streams as they come. Torch-free.

Sample i is the request with seed `sample_seed(seed, i)` (domain.sampling_controls) and request id
`<id>/<i>`. Sharing: samples submitted together are admitted in one engine step, where the prefix
cache holds none of the prompt yet, so each would compute its own copy of every prompt block
(router.prefix_cache keys a block only once its KV is final). So sample 0 goes first, alone; once its
first token is out, its full prompt blocks are in the cache, and samples 1.. are submitted then: each
computes only the prompt's last partial block (and the position that samples its first token). They
wait one prefill for that; a prompt shorter than a block shares nothing and still waits, a cost of
one short prefill. Without a prefix cache (`--no-prefix-cache`; the split topology with copied KV:
the core's ready message tells the gateway) they are submitted together.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from verifypd.core.client import Failure
from verifypd.domain.requests import InvalidRequest, RequestSpec
from verifypd.domain.sampling_controls import sample_seed

# Samples of one request at most (n, best_of): each holds its own KV, so a request may not crowd a
# server out.
MAX_SAMPLES = 16


def check_count(n: int, field: str = "n") -> int:
    """`n` samples (0: one, the proto3 default) or InvalidRequest naming `field`."""
    if n == 0:
        return 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidRequest(f"{field} must be in [1, {MAX_SAMPLES}] (each sample holds its own KV), got {n}")
    return n


def sample_spec(spec: RequestSpec, index: int) -> RequestSpec:
    sampling = dataclasses.replace(spec.sampling, seed=sample_seed(spec.sampling.seed, index))
    return dataclasses.replace(spec, sampling=sampling, request_id=f"{spec.request_id}/{index}")


async def submit_samples(client, spec: RequestSpec, count: int, headers, api: str, share_prefix: bool) -> list:
    """`count` RequestStreams of `spec` (see the module doc). `client`: the gateway's CoreClient;
    `share_prefix`: the server caches prefixes, so samples 1.. wait for sample 0's first token.
    All or none: a refusal cancels the samples already submitted."""
    if count == 1:
        return [await client.submit(spec, headers, api)]
    streams: list = []
    try:
        streams.append(await client.submit(sample_spec(spec, 0), headers, api))
        if share_prefix:
            first = await streams[0].box.take()
            for item in first:  # handed back: the consumer reads them as if nothing had looked
                streams[0].box.put(item)
        for i in range(1, count):
            streams.append(await client.submit(sample_spec(spec, i), headers, api))
    except BaseException:
        for stream in streams:
            client.cancel(stream)
        raise
    return streams


def ends(items: list) -> bool:
    """Whether a batch of a stream's items holds its last one (finished chunk or failure)."""
    return any(isinstance(item, Failure) or getattr(item, "finished", False) for item in items)


async def interleaved(streams: list) -> AsyncIterator[tuple[int, list]]:
    """(sample index, items) as each sample's items arrive, until every sample has ended. A caller
    that stops early (cancelled, closed) leaves no take pending."""
    pending = {asyncio.ensure_future(s.box.take()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                index = pending.pop(fut)
                items = fut.result()
                if not ends(items):
                    pending[asyncio.ensure_future(streams[index].box.take())] = index
                yield index, items
    finally:
        for fut in pending:
            fut.cancel()

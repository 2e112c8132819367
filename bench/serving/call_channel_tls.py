"""What mutual TLS costs a lane call channel round trip (CPU, loopback, no model): the same echo
server and client (verifypd.lanes.rpc.call_channel) plaintext and over mTLS (verifypd.net.lane_tls),
interleaved in rounds so load on a shared machine hits both alike. Certificates are made on the fly.

    PYTHONPATH=services:tests/support python bench/serving/call_channel_tls.py [--calls 3000] [--rounds 5] \
        [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta
from bench_meta import metadata, write_result


def main() -> None:
    from pki_helpers import make_pki

    from verifypd.lanes.rpc.call_channel import CallClient, CallServer
    from verifypd.net.lane_tls import LaneTls
    from verifypd.v1 import lanes_pb2

    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pki = make_pki(tempfile.mkdtemp())

    def echo(call, state):
        return lanes_pb2.LaneReply(kv_bytes_copied=1)

    def median_us(tls, payload: int) -> float:
        server = CallServer(echo, object, "127.0.0.1", 0, "s" * 32, tls)
        client = CallClient("127.0.0.1", server.port, "s" * 32, 5.0, tls)
        call = lanes_pb2.LaneCall(method=lanes_pb2.LANE_METHOD_VERIFY)
        call.batch.wait_event = b"x" * payload  # any bytes field: sizes the frame
        try:
            for _ in range(200):
                client.call(call)
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                client.call(call)
                times.append(time.perf_counter() - t)
        finally:
            client.close()
            server.close()
        return statistics.median(times) * 1e6

    rows = []
    for payload in (0, 16384):
        plain, mtls = [], []
        for _ in range(args.rounds):
            plain.append(median_us(None, payload))
            mtls.append(median_us(LaneTls(*pki["leaf"], pki["ca"][0]), payload))
        row = {
            "payload_bytes": payload,
            "plaintext_median_us": round(statistics.median(plain), 1),
            "mtls_median_us": round(statistics.median(mtls), 1),
            "added_us": round(statistics.median(mtls) - statistics.median(plain), 1),
            "plaintext_rounds_us": [round(v, 1) for v in plain],
            "mtls_rounds_us": [round(v, 1) for v in mtls],
        }
        rows.append(row)
        print(
            f"payload {payload:>6} B: plaintext {row['plaintext_median_us']:.0f} us, mTLS {row['mtls_median_us']:.0f}"
            f" us per round trip (+{row['added_us']:.0f} us)"
        )
    write_result(
        args.out,
        "call_channel_tls",
        {
            **metadata(),
            "calls_per_round": args.calls,
            "rows": rows,
            "note": "loopback echo, no model; medians of per-round medians",
        },
    )


if __name__ == "__main__":
    main()

"""`verifypd serve`, `verifypd lane` and `verifypd generate --server` (registered by verifypd.cli).

verifypd serve [--port 50051] [--topology colocated|split] [--target M] [--draft M]
verifypd lane prefill|draft|verify --port P [--target M] [--draft M]
verifypd generate --server HOST:PORT "PROMPT" [--json] [sampling flags]
"""

from __future__ import annotations

import os

from verifypd.launch.generate_remote import cmd_generate_remote
from verifypd.launch.lane import cmd_lane
from verifypd.launch.serve import cmd_serve
from verifypd.launch.serve_args import add_client_tls_arguments, add_lane_arguments, add_serve_arguments
from verifypd.net.auth import API_KEY_ENV


def register(sub) -> None:
    sub.choices["generate"].set_defaults(handler=cmd_generate_remote)
    sub.choices["generate"].add_argument(
        "--timeout", type=float, default=None, help="with --server: deadline for the whole generation, seconds"
    )
    sub.choices["generate"].add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"with --server: the server's API key (env {API_KEY_ENV})",
    )
    add_client_tls_arguments(sub.choices["generate"], "--server")

    serve = sub.add_parser("serve", help="run the gateway + router and the three lanes")
    add_serve_arguments(serve)
    serve.set_defaults(handler=cmd_serve)

    lane = sub.add_parser("lane", help="run one lane server (split topology)")
    add_lane_arguments(lane)
    lane.set_defaults(handler=cmd_lane)

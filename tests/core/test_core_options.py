"""`verifypd serve`'s arguments resolved into CoreOptions (launch/serve_args.py) and their JSON, the
form in which they reach the engine-core process (core/process.py): a round trip keeps every field,
and no secret is left for a command line."""

from __future__ import annotations

import json

import pytest

from verifypd.domain.config import LanePriorities, RuntimeConfig
from verifypd.domain.options import CoreOptions, EngineOptions, LaneTlsFiles
from verifypd.launch.serve_args import core_options, serve_parser

SECRET = "s" * 40


def test_json_round_trip_keeps_every_field():
    options = CoreOptions(
        engine=EngineOptions(
            target="random:tiny",
            draft="ngram:2-3",
            graph_buckets=(1, 8),
            num_blocks=64,
            config=RuntimeConfig(k_max=7, priorities=LanePriorities(draft=5), schedule="pd"),
            simulated_acceptance=0.5,
            quantization="fp8",
        ),
        topology="split",
        lane_addrs={"prefill": "h:1", "draft": "h:2", "verify": "h:3"},
        lane_secret=SECRET,
        lane_tls=LaneTlsFiles("c.pem", "k.pem", "ca.pem", "lane"),
        kv_transport="copy",
        max_queue=3,
        metrics=True,
    )
    back = CoreOptions.from_json(options.to_json())
    assert back == options
    assert isinstance(back.engine.graph_buckets, tuple) and isinstance(back.engine.config.priorities, LanePriorities)
    assert SECRET not in repr(options)  # logged options never show it


def test_malformed_json_is_refused():
    with pytest.raises((KeyError, TypeError, ValueError)):
        CoreOptions.from_json("[]")
    good = json.loads(CoreOptions().to_json())
    with pytest.raises(TypeError):
        CoreOptions.from_json(json.dumps({**good, "unknown": 1}))


def test_serve_arguments_resolve_without_the_api_key(tmp_path, monkeypatch):
    secret_file = tmp_path / "lane-secret"
    secret_file.write_text(SECRET + "\n")
    args = serve_parser().parse_args(
        [
            "--api-key",
            "a" * 40,
            "--target",
            "random:tiny",
            "--http-port",
            "0",
            "--k-max",
            "6",
            *("--prefill-addr", "h:1", "--draft-addr", "h:2", "--verify-addr", "h:3"),
            *("--lane-secret-file", str(secret_file), "--lane-timeout", "9", "--max-queue", "5"),
        ]
    )
    options = core_options(args)
    assert options.lane_addrs == {"prefill": "h:1", "draft": "h:2", "verify": "h:3"}
    assert options.lane_secret == SECRET and options.lane_timeout_s == 9 and options.max_queue == 5
    assert options.engine.config.k_max == 6 and options.engine.target == "random:tiny" and not options.metrics
    assert "a" * 40 not in options.to_json()  # the gateway checks the API key; the core never sees it


def test_no_lane_secret_without_lane_addresses(monkeypatch):
    monkeypatch.setenv("VERIFYPD_LANE_SECRET", SECRET)
    options = core_options(serve_parser().parse_args(["--topology", "split"]))
    assert options.lane_secret is None and options.lane_addrs == {} and options.metrics


def test_quantization_flag_resolves_and_bad_values_exit_2(capsys):
    args = serve_parser().parse_args(["--target", "random:tiny", "--quantization", "fp8"])
    assert core_options(args).engine.quantization == "fp8"
    assert core_options(serve_parser().parse_args([])).engine.quantization is None
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args(["--quantization", "int4"])
    assert exit_.value.code == 2 and "--quantization: invalid choice: 'int4'" in capsys.readouterr().err

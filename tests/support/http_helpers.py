"""Helpers of the HTTP API tests: a tiny target with a chat template, and a colocated gateway with
its HTTP API on a free port (uvicorn on the gateway's event loop, as `verifypd serve` runs it)."""

from __future__ import annotations

import json
import shutil

import pytest
from services_helpers import SlowLane, engine_options

MODEL = "tiny"
# Renders the messages as plain words: the tiny word-level tokenizer then gives w-ids.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="session")
def chat_models(tiny_models, tmp_path_factory) -> tuple[str, str]:
    """The tiny target with a chat template (a copy: the gRPC tests need one without)."""
    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_models[0], target)
    cfg = target / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    cfg.write_text(json.dumps(data))
    return str(target), tiny_models[1]


class HttpGateway:
    """A started colocated gateway (gRPC) with the HTTP API; `slow` delays every verify call."""

    def __init__(
        self, models, *, max_queue: int = 256, max_body_bytes: int | None = None, api_key: str | None = None, **options
    ):
        from verifypd.core.serving_metrics import ServingMetrics
        from verifypd.core.telemetry import Telemetry, prometheus_reader
        from verifypd.gateway.http_api import HttpApi
        from verifypd.gateway.http_server import HttpServer
        from verifypd.gateway.server import build_colocated

        reader, registry = prometheus_reader()
        self.serving = ServingMetrics(MODEL)  # the vLLM-named series, as `verifypd serve` registers them
        registry.register(self.serving)
        self.telemetry = Telemetry(readers=[reader], serving=self.serving)
        self.gw = build_colocated(engine_options(*models, **options), observer=self.telemetry, max_queue=max_queue)
        self.slow = self.gw.router.verify_lane = SlowLane(self.gw.router.verify_lane)
        self.gw.start()
        kwargs = {"max_body_bytes": max_body_bytes} if max_body_bytes else {}
        self.api = HttpApi(self.gw, model_name=MODEL, metrics_registry=registry, api_key=api_key, **kwargs)
        self.http = HttpServer(self.api.app, "127.0.0.1", 0, grace_s=1.0, loop=self.gw.loop).start()
        self.url = self.http.url

    def blocks_in_use(self) -> tuple[int, int]:
        return self.gw.core_loop.call(lambda r: (r.target_blocks.num_used, r.draft_blocks.num_used))

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def stop(self) -> None:
        self.http.stop()
        self.gw.stop()
        self.telemetry.shutdown()


def sse_events(lines) -> list:
    """`data: ...` lines of a server-sent-event stream, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out

"""What the server says about sliding-window KV (ServerInfo.sliding_window / sliding_window_kv, the
`verifypd` object of the OpenAI /v1/models entry): a model that slides in every layer frees the KV
behind its window, one that mixes local and global layers keeps it, one without a window says nothing.
The split topology reads the window from the target's config."""

from __future__ import annotations

import httpx
import pytest
from family_checkpoints import WINDOW, write_family
from http_helpers import HttpGateway

from verifypd.core.assembly import sliding_fields, split_sliding
from verifypd.domain.options import EngineOptions
from verifypd.v1 import generate_pb2


@pytest.mark.parametrize(
    "family,want", [("mistral", (WINDOW, "freed")), ("gemma2", (WINDOW, "kept")), ("qwen3", (0, ""))]
)
def test_models_entry_and_server_info_say_what_happens_to_windowed_kv(tmp_path, family, want):
    path = str(write_family(tmp_path / family, family))
    gw = HttpGateway((path, "none"), max_context=64)
    try:
        card = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"][0]["verifypd"]
        assert (card["sliding_window"], card["sliding_window_kv"]) == want
        info = gw.gw.info
        assert (info.sliding_window, info.sliding_window_kv) == want
    finally:
        gw.stop()


def test_server_info_over_grpc_carries_the_fields():
    info = generate_pb2.ServerInfo(sliding_window=4096, sliding_window_kv="kept")
    again = generate_pb2.ServerInfo.FromString(info.SerializeToString())
    assert (again.sliding_window, again.sliding_window_kv) == (4096, "kept")


def test_split_topology_reads_the_window_from_the_config(tmp_path):
    path = str(write_family(tmp_path / "mistral", "mistral"))
    assert split_sliding(EngineOptions(target=path, max_context=64), freed=True) == (WINDOW, "freed")
    assert split_sliding(EngineOptions(target="random:phi-3-mini", max_context=None), freed=False) == (2047, "kept")
    assert split_sliding(EngineOptions(target=str(tmp_path / "missing"), max_context=64), freed=True) == (0, "")
    assert sliding_fields(None, (), freed=True) == (0, "")
    assert sliding_fields(8, (0, 1), freed=True) == (8, "freed")

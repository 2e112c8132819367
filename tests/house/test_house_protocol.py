"""The wire contract: checked-in stubs are what proto/generate.py makes; every field is documented."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from google.protobuf import descriptor_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUBS = ROOT / "services" / "verifypd" / "v1"


def test_checked_in_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True, timeout=120
    )
    fresh = sorted(p.relative_to(tmp_path / "verifypd" / "v1") for p in (tmp_path / "verifypd" / "v1").glob("*_pb2*"))
    assert fresh, "generate.py produced no stubs"
    checked_in = sorted(p.relative_to(STUBS) for p in STUBS.glob("*_pb2*"))
    assert fresh == checked_in, "stub files differ: run `python proto/generate.py`"
    stale = [
        str(rel) for rel in fresh if (tmp_path / "verifypd" / "v1" / rel).read_bytes() != (STUBS / rel).read_bytes()
    ]
    assert not stale, f"stale stubs {stale}: run `python proto/generate.py`"


def _descriptors(tmp_path) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    files = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto" / "verifypd" / "v1").glob("*.proto"))
    assert (
        protoc.main(["protoc", f"-I{ROOT / 'proto'}", "--include_source_info", f"--descriptor_set_out={out}", *files])
        == 0
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_every_field_has_a_doc_comment(tmp_path):
    missing, fields = [], 0

    def walk(docs, file_name, messages, path, prefix):
        nonlocal fields
        for mi, m in enumerate(messages):
            if m.options.map_entry:  # synthesized by protoc for `map<,>`; the map field is documented
                continue
            for fi, field in enumerate(m.field):
                fields += 1
                if not docs.get((*path, mi, 2, fi)):
                    missing.append(f"{file_name}: {prefix}{m.name}.{field.name}")
            walk(docs, file_name, m.nested_type, (*path, mi, 3), f"{prefix}{m.name}.")

    for f in _descriptors(tmp_path).file:
        docs = {
            tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
            for loc in f.source_code_info.location
        }
        walk(docs, f.name, f.message_type, (4,), "")
    assert fields > 100
    assert not missing, "fields without a doc comment:\n" + "\n".join(missing)


def test_public_field_numbers_are_stable():
    """loadgen and the operator build on these: renumbering them breaks deployed clients."""
    from verifypd.v1 import control_pb2, generate_pb2

    req = {f.name: f.number for f in generate_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert req == {
        "request_id": 1,
        "text": 2,
        "token_ids": 3,
        "chat": 4,
        "sampling": 5,
        "max_tokens": 6,
        "stop": 7,
        "speculation": 8,
        "priority": 9,
        "stop_at_eos": 10,
        "constraint": 11,
        "n": 12,
    }
    sampling = {f.name: f.number for f in generate_pb2.SamplingParams.DESCRIPTOR.fields}
    assert sampling == {
        "temperature": 1,
        "top_p": 2,
        "top_k": 3,
        "seed": 4,
        "presence_penalty": 5,
        "frequency_penalty": 6,
        "repetition_penalty": 7,
        "min_tokens": 8,
        "logit_bias": 9,
        "stop_token_ids": 10,
        "logprobs": 11,
        "top_logprobs": 12,
    }
    constraint = {f.name: f.number for f in generate_pb2.OutputConstraint.DESCRIPTOR.fields}
    assert constraint == {"json_object": 1, "json_schema": 2, "regex": 3, "grammar": 4}
    resp = {f.name: f.number for f in generate_pb2.GenerateResponse.DESCRIPTOR.fields}
    assert resp == {
        "request_id": 1,
        "token_ids": 2,
        "text": 3,
        "finish_reason": 4,
        "usage": 5,
        "applied_k": 6,
        "server_elapsed_s": 7,
        "logprobs": 8,
        "choice_index": 9,
    }
    usage = {f.name: f.number for f in generate_pb2.Usage.DESCRIPTOR.fields}
    assert usage == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "draft_tokens": 3,
        "accepted_tokens": 4,
        "verify_steps": 5,
        "cached_tokens": 6,
    }
    cfg = {f.name: f.number for f in control_pb2.RuntimeConfig.DESCRIPTOR.fields}
    assert cfg == {
        "k_min": 1,
        "k_max": 2,
        "k_initial": 3,
        "adaptive": 4,
        "priorities": 5,
        "prefill_token_budget": 6,
        "revision": 7,
    }

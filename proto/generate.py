"""Regenerate the Python stubs of proto/verifypd/v1/*.proto into services/verifypd/v1/.

    python proto/generate.py            # write stubs in place
    python proto/generate.py --out DIR  # write into DIR (used by the staleness test)

Stubs are checked in so that installing verifypd needs no protoc; tests/test_proto_stubs.py
fails when they differ from what this script produces.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "verifypd" / "v1").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files(),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed: " + " ".join(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "services")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())

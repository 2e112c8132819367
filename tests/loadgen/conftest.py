"""Fixtures for the loadgen tests: an in-process fake Generate server and a CLI runner."""

from __future__ import annotations

import pytest

from verifypd_loadgen import cli, fake_server


@pytest.fixture
def fake():
    """fake(**FakeConfig fields) -> (servicer, "127.0.0.1:PORT"); servers stop at teardown."""
    servers = []

    def start(**kw):
        server, servicer, port = fake_server.start(fake_server.FakeConfig(**kw), "127.0.0.1", 0, max_workers=32)
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture
def loadgen(capsys):
    """loadgen(*argv) -> (exit code, stdout, stderr) of the CLI run in-process."""

    def run(*argv):
        capsys.readouterr()
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse errors
            rc = e.code
        out, err = capsys.readouterr()
        return rc, out, err

    return run

"""lanes.processes.child_env: torch threads of the processes verifypd spawns (docs/services.md "CPU threads")."""

from __future__ import annotations

import os

from verifypd.lanes.processes import AUTO_THREADS_ENV, child_env


def test_a_spawned_torch_process_gets_its_share_of_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(AUTO_THREADS_ENV, raising=False)
    assert child_env(core_share=2)["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert child_env(core_share=6)["OMP_NUM_THREADS"] == str(max(1, cores // 6))
    assert "OMP_NUM_THREADS" not in child_env()  # no share given: torch's default, as before


def test_the_users_setting_wins_and_ours_is_recomputed_for_grandchildren(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv(AUTO_THREADS_ENV, raising=False)
    assert child_env(core_share=6)["OMP_NUM_THREADS"] == "7"
    # The engine core's own value (chosen by the gateway) is not passed on to its lanes as is.
    monkeypatch.setenv(AUTO_THREADS_ENV, "1")
    assert child_env(core_share=1000)["OMP_NUM_THREADS"] == "1"

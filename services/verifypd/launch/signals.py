"""Waiting for SIGTERM/SIGINT: how `serve` and `lane` run until they are told to stop."""

from __future__ import annotations

import logging
import signal
import threading


def wait_for_signal(poll=None) -> None:
    """Blocks until SIGTERM/SIGINT (or poll() returns True)."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        logging.getLogger("verifypd").info("received %s", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stop.wait(0.5):
        if poll is not None and poll():
            return

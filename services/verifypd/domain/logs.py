"""What every verifypd process logs the same way: the log set-up, the rate limit on lines that a
flood of connections or bad messages repeats, and the warning of a server whose acceptance is
simulated (`--simulated-acceptance`, benchmarks only). Torch-free."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time

SIMULATED_WARNING = (
    "SIMULATED ACCEPTANCE alpha=%g (--simulated-acceptance): BENCHMARK ONLY. Draft tokens are "
    "accepted at random with this probability instead of by the target model; every output of "
    "this server is NOT the target model's output. Never serve real traffic like this."
)


LOG_FORMAT_ENV = "VERIFYPD_LOG_FORMAT"  # text | json; `serve --log-format` sets it for its children
# Fields a log call may pass in `extra=` that the JSON lines carry as keys of their own.
FIELDS = ("request_id", "trace_id", "lane", "reason", "api", "outcome", "prompt_tokens", "output_tokens", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601, ms), level, logger, msg, the FIELDS a call
    passed, and exc (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(fmt: str | None = None) -> None:
    """`fmt`: text | json (default: $VERIFYPD_LOG_FORMAT, else text)."""
    fmt = fmt or os.environ.get(LOG_FORMAT_ENV, "text")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=os.environ.get("VERIFYPD_LOG_LEVEL", "INFO"), handlers=[handler])
    for name in FLOODABLE:
        rate_limited(logging.getLogger(name))


# Loggers whose lines a client can make us repeat without limit: asyncio's accept loop ("socket.accept()
# out of system resource ... Too many open files", once per loop turn while fds are exhausted), gRPC's
# server (a traceback per undecodable message, per failed handshake), uvicorn's protocol errors.
FLOODABLE = ("asyncio", "grpc._server", "grpc._cython.cygrpc", "grpc.aio", "uvicorn.error", "verifypd.wire")


class RateLimit(logging.Filter):
    """At most `burst` records per `per_s` seconds per (logger, message template); the rest are
    counted, and the next record let through says how many were suppressed. Thread-safe."""

    def __init__(self, burst: int = 5, per_s: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._windows: dict[tuple[str, str], list] = {}  # key -> [window start, records let through, suppressed]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self.clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.per_s:
                suppressed = window[2] if window is not None else 0
                self._windows[key] = window = [now, 0, 0]
                if len(self._windows) > 1000:  # many distinct templates: forget the old windows
                    self._windows = {key: window}
            else:
                suppressed = 0
            if window[1] >= self.burst:
                window[2] += 1
                return False
            window[1] += 1
        if suppressed:
            record.msg = f"{record.msg} [suppressed {suppressed} similar lines in the last {self.per_s:.0f} s]"
        return True


def rate_limited(logger: logging.Logger, burst: int = 5, per_s: float = 10.0) -> logging.Logger:
    """`logger` with a RateLimit filter (once: calling it again changes nothing)."""
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit(burst, per_s))
    return logger


def simulated_label(options) -> str:
    """The words the start-up lines add when acceptance is simulated ('' otherwise)."""
    alpha = getattr(options, "simulated_acceptance", None)
    return "" if alpha is None else f", SIMULATED ACCEPTANCE alpha={alpha:g} (benchmark only)"


def warn_simulated(options) -> None:
    if getattr(options, "simulated_acceptance", None) is not None:
        logging.getLogger("verifypd").warning(SIMULATED_WARNING, options.simulated_acceptance)

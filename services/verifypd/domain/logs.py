"""What every verifypd process logs the same way: the log set-up, and the warning of a server whose
acceptance is simulated (`--simulated-acceptance`, benchmarks only). Torch-free."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

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


def simulated_label(options) -> str:
    """The words the start-up lines add when acceptance is simulated ('' otherwise)."""
    alpha = getattr(options, "simulated_acceptance", None)
    return "" if alpha is None else f", SIMULATED ACCEPTANCE alpha={alpha:g} (benchmark only)"


def warn_simulated(options) -> None:
    if getattr(options, "simulated_acceptance", None) is not None:
        logging.getLogger("verifypd").warning(SIMULATED_WARNING, options.simulated_acceptance)

"""What every verifypd process logs the same way: the log set-up, and the warning of a server whose
acceptance is simulated (`--simulated-acceptance`, benchmarks only). Torch-free."""

from __future__ import annotations

import logging
import os
import sys

SIMULATED_WARNING = (
    "SIMULATED ACCEPTANCE alpha=%g (--simulated-acceptance): BENCHMARK ONLY. Draft tokens are "
    "accepted at random with this probability instead of by the target model; every output of "
    "this server is NOT the target model's output. Never serve real traffic like this."
)


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("VERIFYPD_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def simulated_label(options) -> str:
    """The words the start-up lines add when acceptance is simulated ('' otherwise)."""
    alpha = getattr(options, "simulated_acceptance", None)
    return "" if alpha is None else f", SIMULATED ACCEPTANCE alpha={alpha:g} (benchmark only)"


def warn_simulated(options) -> None:
    if getattr(options, "simulated_acceptance", None) is not None:
        logging.getLogger("verifypd").warning(SIMULATED_WARNING, options.simulated_acceptance)

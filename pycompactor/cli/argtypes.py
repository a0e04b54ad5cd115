"""Argument types of the command line.

Each parses one command-line value or raises `argparse.ArgumentTypeError` with the
message argparse prints after the usage line (exit status 2). No other module of the
package depends on argparse's types, so the commands (`cli`, `audit`) share these.
"""

from __future__ import annotations

import argparse
import math
from typing import Final


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _at_least(value: int, low: int) -> int:
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a number of at least {low}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None


#: The largest whole number an argument takes: every count the command line passes on
#: reaches PostgreSQL as an int (a larger one was a driver error after connecting).
MAX_INT: Final = 2**31 - 1
#: --concurrency: model calls in flight in one process; compaction.settings.max_running
#: admits at most 10,000 across all workers, so more could never run.
MAX_CONCURRENCY: Final = 10_000
#: The longest wait any --...-seconds option takes (a day): past it, an Event's wait
#: overflows, and nothing here needs to wait longer.
MAX_SECONDS: Final = 86_400.0


def _at_most(value: int, high: int) -> int:
    if value > high:
        raise argparse.ArgumentTypeError(f"expected a number of at most {high}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _at_most(_at_least(_whole(text), 1), MAX_INT)


def non_negative_int(text: str) -> int:
    return _at_most(_at_least(_whole(text), 0), MAX_INT)


def concurrency(text: str) -> int:
    return _at_most(_at_least(_whole(text), 1), MAX_CONCURRENCY)


def budget_bytes(text: str) -> int:
    # The bound is the projection's own (check_budget): refused here, it is a usage error
    # rather than a failure after connecting.
    from pycompactor.projection import MAX_BUDGET_BYTES

    value = _at_least(_whole(text), 0)  # a bigint, not an int: its own bound below
    if value > MAX_BUDGET_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_BUDGET_BYTES} bytes, got {value}")
    return value


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {value}")
    return value


def positive_float(text: str) -> float:
    value = _seconds(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS:g} seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _seconds(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS:g} seconds, got {text}")
    return value


def database_timeout(text: str) -> float:
    # PostgreSQL counts lock_timeout and statement_timeout in whole milliseconds, and 0
    # means no limit at all: a shorter positive value would silently turn it off.
    from pycompactor.db import MAX_TIMEOUT_MS, MIN_TIMEOUT_MS

    value = _seconds(text)
    if not MIN_TIMEOUT_MS / 1000 <= value <= MAX_TIMEOUT_MS / 1000:  # NaN fails this too
        raise argparse.ArgumentTypeError(
            f"expected {MIN_TIMEOUT_MS / 1000:g} to {MAX_TIMEOUT_MS / 1000:g} seconds "
            f"(PostgreSQL counts whole milliseconds), got {text}")
    return value


def lease_seconds(text: str) -> float:
    # The engine grants leases of 1 second to 1 day (CP023 otherwise): say so up front.
    value = positive_float(text)
    if not 1.0 <= value <= 86400.0:
        raise argparse.ArgumentTypeError(f"expected 1 to 86400 seconds, got {text}")
    return value


def retention_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a share between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {text}")
    return value


def temperature(text: str) -> float | None:
    """A sampling temperature from 0 to 2, or "none" (send none)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a temperature from 0 to 2 or 'none', got {text!r}") from None
    if not 0.0 <= value <= 2.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected a temperature from 0 to 2, got {text}")
    return value


def invented_figures_allowed(text: str) -> int:
    # The worker's own bound (WorkerConfig): refused here, it is a usage error.
    from pycompactor.quality.figures import MAX_INVENTED_FIGURES_BOUND

    value = non_negative_int(text)
    if value > MAX_INVENTED_FIGURES_BOUND:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_INVENTED_FIGURES_BOUND} figures, got {value}")
    return value

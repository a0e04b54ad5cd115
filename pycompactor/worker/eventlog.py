"""The worker's event log: one line per event, `key=value` text or one JSON object, with
every secret masked; and what counts as a secret (the command line's one-line errors
mask the same).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal, TextIO

from pycompactor import db

LogFormat = Literal["text", "json"]

class EventLog:
    """One line per event on a stream: `key=value` text by default, or one JSON object.

    Secrets (the API key, the DSN password) are replaced by `***` in every field, so no
    driver or client message can leak them.

    A stream that refuses a write (its pipe's reader went away, a full disk) makes the
    log `broken`: that event and every later one are dropped and `emit` never raises,
    so no thread of the worker dies halfway through a state change for want of a log
    line. The worker watches `broken`: it stops as on SIGTERM and exits non-zero.
    """

    def __init__(self, log_format: LogFormat = "text", stream: TextIO | None = None,
                 secrets: Sequence[str] = ()) -> None:
        self._format = log_format
        self._stream = stream
        # Short strings would be masked all over the log; real secrets are longer.
        self._secrets = [s for s in secrets if len(s) >= 4]
        self._lock = threading.Lock()
        self._broken = False

    @property
    def broken(self) -> bool:
        """True once a write to the stream has failed (nothing is written after that)."""
        return self._broken

    def _redact(self, value: object) -> object:
        return redact(value, self._secrets) if isinstance(value, str) else value

    def emit(self, event: str, **fields: object) -> None:
        record: dict[str, object] = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "event": event,
        }
        record.update((k, self._redact(v)) for k, v in fields.items() if v is not None)
        if self._format == "json":
            # JSON escapes C0 controls; the rest of what a terminal would act on is
            # escaped the same way (a conversation id is the host's, not ours).
            line = _escape_unprintable(json.dumps(record, ensure_ascii=False, default=str))
        else:
            parts = [str(record.pop("ts")), str(record.pop("event"))]
            parts += [f"{_text_value(k)}={_text_value(v)}" for k, v in record.items()]
            line = " ".join(parts)
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            if self._broken:
                return
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):  # ValueError: the stream was closed
                self._broken = True


def _text_value(value: object) -> str:
    if isinstance(value, datetime):
        text = value.isoformat()  # as `ts` is written; no space, so never quoted
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=str)
        if text.startswith('"'):
            # A type JSON lacks, as text (a UUID, an interval): quoted once, below, if at all.
            text = str(value)
    # Quote only what would break `key=value` splitting, or what a terminal would act on
    # (ESC, BEL, C1 controls, bidirectional overrides: ids are the host's).
    if text == "" or any(c.isspace() or c in "\"=" or not c.isprintable() for c in text):
        return _escape_unprintable(json.dumps(text, ensure_ascii=False))
    return text


def _escape_unprintable(text: str) -> str:
    """JSON text with every character that is not printable (and not a plain space) as
    its JSON escape: JSON itself escapes only C0 controls, quotes and backslashes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " "
                   else json.dumps(c, ensure_ascii=True)[1:-1] for c in text)


def secrets_of(dsn: str | None) -> list[str]:
    """What must never be shown: the DSN's password (also as libpq would quote a malformed
    DSN), PGPASSWORD and the API key; longest first, so a secret containing another is
    masked whole. Short strings would be masked all over the output: real secrets are
    longer."""
    found = db.dsn_passwords(db.resolve_dsn(dsn))
    found += [os.environ.get(name, "") for name in ("PGPASSWORD", "OPENAI_API_KEY")]
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text

"""Log set-up: human-readable lines by default, one JSON object a line when asked.

A log call may pass structured data as `extra={"fields": {...}}`: the JSON formatter puts
the fields at the top level of the object, the text formatter appends them as `key=value`.
"""

from __future__ import annotations

import logging
import sys

import orjson


def _fields(record: logging.LogRecord) -> dict[str, object] | None:
    extra = getattr(record, "fields", None)
    return extra if isinstance(extra, dict) else None


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = _fields(record)
        if extra:
            doc.update(extra)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = _fields(record)
        if not extra:
            return line
        pairs = " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
        head, nl, tail = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {pairs}{nl}{tail}"


def configure_logging(level: str = "info", json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log would duplicate ours (which never holds prompt text).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

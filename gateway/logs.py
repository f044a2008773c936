"""Log set-up: human-readable lines by default, one JSON object a line when asked.

A log call may pass structured data as `extra={"fields": {...}}`: the JSON formatter puts
the fields at the top level of the object, the text formatter appends them as `key=value`.

Messages and fields may carry client strings (a model name, a header value): the text formatter
escapes control characters in them, so no client can start a forged log line, and both formatters
cut a message or field at `MAX_FIELD_CHARS`. Tracebacks keep their lines, as does a block of text
passed as `extra={"block": text}` (a crashed engine's log tail): the text formatter writes each of
its lines after the message, indented behind `| ` and escaped, so none can pass for a log line.
"""

from __future__ import annotations

import logging
import re
import sys
import time

import orjson
from aiohttp.http_exceptions import HttpProcessingError

MAX_FIELD_CHARS = 4096
BLOCK_CHARS = 64 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def clip(value: str, limit: int = 200) -> str:
    """A client string made safe to log or to echo in an error: control characters escaped
    (\\n, \\x1b, ...), cut at `limit` characters with a note of the full length."""
    if len(value) > limit:
        value = f"{value[:limit]}...({len(value)} chars)"
    if _CONTROL.search(value):
        value = _CONTROL.sub(lambda m: repr(m.group())[1:-1], value)
    return value


def _fields(record: logging.LogRecord) -> dict[str, object] | None:
    extra = getattr(record, "fields", None)
    return extra if isinstance(extra, dict) else None


def _block(record: logging.LogRecord) -> str | None:
    block = getattr(record, "block", None)
    return block if isinstance(block, str) else None


def _cut(value: str) -> str:
    return value if len(value) <= MAX_FIELD_CHARS else f"{value[:MAX_FIELD_CHARS]}...({len(value)} chars)"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _cut(record.getMessage()),
        }
        extra = _fields(record)
        if extra:
            doc.update({k: _cut(v) if isinstance(v, str) else v for k, v in extra.items()})
        block = _block(record)
        if block is not None:
            doc["block"] = block[-BLOCK_CHARS:]
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # logging.Formatter's own format, the date and time formatted once a second, not per line.
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(record.created))
        msec_format = self.default_msec_format
        return msec_format % (self._stamp, record.msecs) if msec_format else self._stamp

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The message alone (the traceback is appended after this): one line, whatever it holds.
        record.message = clip(record.message, MAX_FIELD_CHARS)
        line = super().formatMessage(record)
        block = _block(record)
        if block is not None:
            lines = block[-BLOCK_CHARS:].splitlines()
            line += "".join(f"\n    | {clip(text, MAX_FIELD_CHARS)}" for text in lines)
        extra = _fields(record)
        if not extra:
            return line
        # Joined as they are first: when the whole is short and holds no control character, no
        # field needed clipping (an access log line: 12 -> 8 us).
        pairs = " ".join([f"{k}={v}" for k, v in extra.items() if v is not None])
        if len(pairs) > MAX_FIELD_CHARS or _CONTROL.search(pairs):
            pairs = " ".join(
                f"{k}={clip(v, MAX_FIELD_CHARS) if isinstance(v, str) else v}"
                for k, v in extra.items()
                if v is not None
            )
        return f"{line} {pairs}"


class MalformedRequests(logging.Filter):
    """aiohttp logs each malformed request (bad framing, oversized head, smuggling attempts) as an
    error with a traceback: it is the client's mistake, already answered 400, and a flood of them
    would flood the log. Such records pass only when debug logging is on, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = f"{record.getMessage()}: malformed request: {exc.message}"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


def configure_logging(level: str = "info", json: bool = False) -> None:
    # Neither formatter prints where a call was made, nor the thread or process: not looked up
    # for each record (the logging HOWTO's "Optimization"; 1.4 us an access log line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log would duplicate ours (which never holds prompt text).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server_log.filters):
        server_log.addFilter(MalformedRequests())

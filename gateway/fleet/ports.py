"""Free TCP ports for launched engines: probed by binding, never handed out twice by this process."""

from __future__ import annotations

import socket
import threading

_lock = threading.Lock()
# Ports this gateway already gave to an engine: a probe that finds one free (the engine not
# listening yet, or restarting) must not hand it to a second engine.
_reserved: set[int] = set()


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # No SO_REUSEADDR: a port in TIME_WAIT counts as busy, like it would for the engine.
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reserve_port(host: str, port: int) -> int:
    """Claim a specific port; raises OSError if it is taken or already claimed."""
    with _lock:
        if port in _reserved or not port_is_free(host, port):
            raise OSError(f"port {port} on {host} is already in use")
        _reserved.add(port)
        return port


def reserve_free_port(
    host: str, start: int | None = None, count: int = 1, avoid: frozenset[int] = frozenset()
) -> int:
    """The first of `count` consecutive free ports: the first such run from `start` upwards (none of
    them in `avoid`), or from a port the kernel picks (bind to 0). All `count` ports are reserved."""
    with _lock:
        if start is not None:
            for port in range(start, 65536 - count + 1):
                if avoid.isdisjoint(range(port, port + count)) and _claim(host, port, count):
                    return port
            raise OSError(f"no {count} free port(s) from {start} upwards on {host}")
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port + count <= 65536 and _claim(host, port, count):
                return port
        raise OSError(f"no {count} free port(s) on {host}")


def _claim(host: str, first: int, count: int) -> bool:
    ports = range(first, first + count)
    if any(p in _reserved or not port_is_free(host, p) for p in ports):
        return False
    _reserved.update(ports)
    return True


def release_ports(ports: list[int]) -> None:
    with _lock:
        _reserved.difference_update(ports)

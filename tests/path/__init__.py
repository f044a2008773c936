"""Tests of gateway/path: the request path (proxy, PD hand-off, sanitizing, transports, claims)."""

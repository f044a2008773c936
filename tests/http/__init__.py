"""Tests of gateway/http: the client-facing surface (hostile clients, bodies, connections)."""

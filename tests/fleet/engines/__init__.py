"""Tests of gateway/fleet/engines: one adapter per engine kind."""

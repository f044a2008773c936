"""Tests of gateway/control: the admin API, shared state, config checks and reloads."""

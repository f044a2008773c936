"""Tests of gateway/observe: metrics, tracing, the access log, the status page."""

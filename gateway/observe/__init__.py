"""What a running gateway reports: Prometheus metrics, OpenTelemetry tracing, the access log
and the status page.

May import: path, admission, routing, fleet and the base modules; never http or control
(what it reads of them comes in as narrow handles).
"""

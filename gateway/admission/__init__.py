"""Whether and when a request runs: priority classes, the scheduler (order and admission
only) and per-tenant rate limits.

May import: routing, prompt, fleet and the base modules.
"""

"""Whether and when a request runs: priority classes, the scheduler (order and admission
only), per-tenant rate limits, and the prompt window.

May import: routing, fleet and the base modules.
"""

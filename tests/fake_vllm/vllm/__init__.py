"""Stand-in for vLLM in dry runs of bench/gpu (see entrypoints/cli/main.py)."""

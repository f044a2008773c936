"""Dry runs of bench/gpu: `python3 -m vllm.entrypoints.cli.main serve MODEL FLAGS...` served by kvgate's
simulator, so that the managed fleet's real command line (bench/gpu/fleet.yaml.tmpl) runs unchanged.

On PYTHONPATH only in dry runs (bench/gpu/dry_run.sh) and tests, ahead of any real vLLM. The
simulator takes vLLM's flags (and ignores, with a warning, those it does not model: --load-format
and the like); FAKE_VLLM_STARTUP_S seconds of 503 from /health stand in for load and compile time, and
FAKE_VLLM_PROFILE names the simulator's profile for the model's shape (bench/gpu/card.py sets it).
"""

import os
import sys

from gateway.sim.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ.get("FAKE_VLLM_STARTUP_S"):
        argv += ["--startup-delay", os.environ["FAKE_VLLM_STARTUP_S"]]
    if os.environ.get("FAKE_VLLM_PROFILE"):
        argv += ["--profile", os.environ["FAKE_VLLM_PROFILE"]]
    sys.exit(main(argv))

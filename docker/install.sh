#!/bin/sh
# How kvgate is installed: with its runtime dependencies only, from a wheel. The Docker image runs
# this (`wheel` in its build stage, `install` in the final one), and so does the test that installs
# kvgate into a fresh virtual environment and serves a completion (tests/test_install.py): both
# run exactly these commands with whatever `pip` is first on PATH (the image sets PIP_NO_CACHE_DIR,
# the test lets pip use its cache).
#   install.sh wheel SRC_DIR WHEEL_DIR   build kvgate's wheel (no dependencies) from the source tree
#   install.sh install WHEEL_DIR         install that wheel and its runtime dependencies
set -eu
case "${1:-}" in
wheel)
    pip wheel --no-deps --wheel-dir "$3" "$2"
    ;;
install)
    pip install "$2"/kvgate-*.whl
    ;;
*)
    echo "usage: $0 wheel SRC_DIR WHEEL_DIR | install WHEEL_DIR" >&2
    exit 2
    ;;
esac

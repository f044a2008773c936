#!/bin/sh
# How kvgate is installed: from a wheel, with its runtime dependencies (and the extras named) only.
# The Docker image runs this (`wheel` in its build stage, `install` in the final one), and so does
# the test that installs kvgate into a fresh virtual environment and serves a completion
# (tests/test_install.py, with the image's arguments): both run exactly these commands with
# whatever `pip` is first on PATH (the image sets PIP_NO_CACHE_DIR; the test points pip at a local
# wheelhouse).
#   install.sh wheel SRC_DIR WHEEL_DIR   build kvgate's wheel (no dependencies) from the source tree
#   install.sh install WHEEL_DIR [EXTRAS] install that wheel, its runtime dependencies and the named
#                                        extras (comma-separated, e.g. kvevents,kubernetes)
set -eu
case "${1:-}" in
wheel)
    pip wheel --no-deps --wheel-dir "$3" "$2"
    ;;
install)
    wheel=$(echo "$2"/kvgate-*.whl)
    pip install "$wheel${3:+[$3]}"
    ;;
*)
    echo "usage: $0 wheel SRC_DIR WHEEL_DIR | install WHEEL_DIR [EXTRAS]" >&2
    exit 2
    ;;
esac

"""Every example config in config/ is valid as shipped: `kvgate check-config` accepts it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, subprocess_env

EXAMPLES = sorted((REPO / "config").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_passes_check_config(path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "gateway", "check-config", str(path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr

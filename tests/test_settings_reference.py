"""docs/settings.md is the settings reference generated from the configuration schema: every key,
its type, default and meaning. It fails here when a setting changes and the page does not, or a
setting comes without a description; `kvgate config reference` prints it."""

from __future__ import annotations

import subprocess

from gateway.config import REFERENCE_COMMAND, setting_keys, settings_reference
from tests.conftest import PYTHON, REPO, STARTUP_S, subprocess_env

PAGE = REPO / "docs" / "settings.md"


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text() == settings_reference(), f"docs/settings.md is stale: run `{REFERENCE_COMMAND}`"


def test_every_setting_says_what_it_means() -> None:
    missing = [key for key, info in setting_keys() if not info.description]
    assert not missing, f"settings without Field(description=...): {missing}"


def test_the_scheduler_settings_the_docs_never_named_are_on_the_page() -> None:
    page = PAGE.read_text()
    for key in (
        "max_queue",
        "queue_timeout_s",
        "max_waiting_per_replica",
        "max_kv_usage",
        "max_inflight_requests_per_replica",
        "expected_output_tokens",
        "aging_s",
        "retry_after_s",
    ):
        assert f"| `scheduler.{key}` |" in page, key
    # A row: key, type with its bounds, default, meaning.
    assert (
        "| `scheduler.max_waiting_per_replica` | int, >= 0 | `4` | "
        "Engine waiting queue above this: no headroom |" in page
    )
    assert "| `pools[].engines.replicas` | int, >= 1 | `1` |" in page


def test_kvgate_config_reference_prints_it() -> None:
    out = subprocess.run(
        [PYTHON, "-m", "gateway", "config", "reference"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == PAGE.read_text()


def test_the_page_is_linked_where_a_reader_looks() -> None:
    assert "(settings.md)" in (REPO / "docs" / "configuration.md").read_text()
    assert "| [docs/settings.md](docs/settings.md) |" in (REPO / "README.md").read_text()

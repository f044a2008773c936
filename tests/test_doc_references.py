"""docs/check_links.py: what a user reads leads somewhere inside the repository (links, plain-text
paths, no tracker numbers, nothing outside the checkout), in the pages, the commands' help and the
shipped YAML; `make test` runs it on the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "docs"))
import check_links


def test_a_page_with_references_a_user_cannot_follow_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "Measured as shared/engines.md says, see issue 18 and #29.",  # 1: notes, two trackers
                "Then run `bash gpu/kvgate/start4.sh` (calibration-h200-vllm.md).",  # 2: two missing files
                "Notes in /srv/notes/x.md; data in ../../../elsewhere/data.",  # 3: one machine's, outside
                "See `gateway/no_such_module.py` and `results/no-such-run/`.",  # 4: repo-looking, missing
                # Nothing below is wrong: repository files, an output folder git ignores, an upstream
                # project's source, a placeholder, an elided path, a heading anchor.
                "`gateway/config.py`, `results/out/routing/report.md`, vLLM's `vllm/config/cache.py`,",
                "`kubectl port-forward deploy/RELEASE-kvgate`, `.../cpu/manager.py`,",
                "`bench/scenarios/*.yaml`,",
                "[engines](#page) and `path/proxy.py` (under gateway/).",
                "# page",
            ]
        )
    )
    sources = [("page.md", page.read_text(), tmp_path)]
    found = [line.split(": ", 1)[1] for line in check_links.plain_text(sources, set(check_links.tracked()))]
    assert found == [
        "'issue 18' cites a tracker: say the fact",
        "'#29' cites a tracker: say the fact",
        "shared/engines.md: outside the repository",
        "gpu/kvgate/start4.sh: no such file in the repository",
        "calibration-h200-vllm.md: no such file in the repository",
        "/srv/notes/x.md: a file outside the repository",
        "../../../elsewhere/data: outside the repository",
        "gateway/no_such_module.py: no such file in the repository",
        "results/no-such-run/: no such file in the repository",
    ], found
    assert check_links.broken(page) == []


def test_the_commands_help_is_read_including_sub_commands() -> None:
    kvgate = check_links.command_help("gateway.cli")
    assert "check-config" in kvgate and "usage: kvgate launch" in kvgate
    assert "usage: kvgate bench scenario" in check_links.command_help("bench.cli")
    assert "--speedup" in check_links.command_help("gateway.sim.cli")


def test_the_repository_passes() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "docs" / "check_links.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert out.stdout.rstrip().endswith(", 0 broken")

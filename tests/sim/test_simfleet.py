"""The test helper that starts simulator processes: it must see every replica's line, however the
lines arrive on its pipe."""

from __future__ import annotations

from tests.conftest import PYTHON
from tests.simfleet import sim_command

# Both replicas' lines in one write, then silence: what a loaded machine's pipe delivers when the
# reader falls behind. A reader that buffers lines unseen by select() waits out its timeout here.
TWO_LINES_AT_ONCE = (
    "import sys, time\n"
    "sys.stdout.write('kvgate-sim listening on http://a\\nkvgate-sim listening on http://b\\n')\n"
    "sys.stdout.flush()\n"
    "time.sleep(600)\n"
)


def test_lines_that_arrive_together_are_all_seen() -> None:
    with sim_command([PYTHON, "-c", TWO_LINES_AT_ONCE], replicas=2, timeout=30) as fleet:
        assert fleet.urls == ["http://a", "http://b"]

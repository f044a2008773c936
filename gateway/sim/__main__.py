"""`python -m gateway.sim`: see gateway.sim.cli."""

import sys

from gateway.sim.cli import main

sys.exit(main())

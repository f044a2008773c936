"""`python -m bench ...`: the same as `kvgate bench ...`."""

from bench.cli import main

raise SystemExit(main())

"""`python -m planner.cli`: the `hyplan` command."""

from planner.cli.command import main

raise SystemExit(main())

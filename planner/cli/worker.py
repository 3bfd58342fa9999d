"""What each torchrun process of `hyplan train` runs: `python -m planner.cli.worker`
(planner.cli.train's `worker`, from a module the package does not import first)."""

from planner.cli.train import worker

if __name__ == "__main__":
    raise SystemExit(worker())

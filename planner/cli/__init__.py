"""The `hyplan` command line, above the planner and the report (nothing below imports it)."""

from planner.cli.command import main
from planner.cli.model_args import build_model, forward_kwargs, load_factory, parse_memory

__all__ = ["build_model", "forward_kwargs", "load_factory", "main", "parse_memory"]

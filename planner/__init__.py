"""Choose how to parallelize a model, layer by layer, with an integer program."""

from planner import report  # noqa: F401  installs Plan.explain()'s renderer (planner.plan)
from planner.baseline import baseline
from planner.optimize import optimize
from planner.plan import Plan, PlanFileError
from planner.plan3d import optimize_3d
from planner.price_job import price_job
from planner.profiled import PlanDoesNotFit

__all__ = ["Plan", "PlanDoesNotFit", "PlanFileError", "baseline", "optimize", "optimize_3d",
           "price_job"]

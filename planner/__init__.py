"""Choose how to parallelize a model, layer by layer, with an integer program."""

from planner.baseline import baseline
from planner.optimize import PlanDoesNotFit, optimize
from planner.plan import Plan, PlanFileError
from planner.plan3d import optimize_3d

__all__ = ["Plan", "PlanDoesNotFit", "PlanFileError", "baseline", "optimize", "optimize_3d"]

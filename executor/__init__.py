"""Run a Plan: rewrite the module for this rank and feed it its part of the batch."""

from executor.batch import shard_batch
from executor.monitor import Drift, StepMonitor, check_step_time
from executor.parallelize import PlanMismatch, parallelize

__all__ = ["Drift", "PlanMismatch", "StepMonitor", "check_step_time", "parallelize",
           "shard_batch"]

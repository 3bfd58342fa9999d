"""Run a Plan: rewrite the module for this rank and feed it its part of the batch."""

from executor.batch import shard_batch
from executor.parallelize import PlanMismatch, parallelize
from executor.styles import register_style
from executor.transformer_styles import full_parameters

__all__ = ["PlanMismatch", "full_parameters", "parallelize", "register_style", "shard_batch"]

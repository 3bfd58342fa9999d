"""Run a Plan: rewrite the module for this rank and feed it its part of the batch."""

from executor.batch import shard_batch
from executor.parallelize import PlanMismatch, parallelize
from executor.step import train_step

__all__ = ["PlanMismatch", "parallelize", "shard_batch", "train_step"]

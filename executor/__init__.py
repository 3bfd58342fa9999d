"""Run a Plan: rewrite the module for this rank, feed it its part of the batch, train."""

from executor.batch import RankBatch, shard_batch
from executor.parallelize import PlanMismatch, parallelize
from executor.step import train_step
from executor.train import TrainResult, train  # binds executor.train to the function

__all__ = ["PlanMismatch", "RankBatch", "TrainResult", "parallelize", "shard_batch", "train", "train_step"]

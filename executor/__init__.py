"""Run a Plan: rewrite the module for this rank, feed it its part of the batch, train."""

from executor.agree import PlanMismatch
from executor.batch import RankBatch, shard_batch, shard_keywords
from executor import experts as _experts  # noqa: F401 - registers the expert_parallel style
from executor.monitor import Drift, StepMonitor, check_step_time
from executor.parallelize import parallelize
from executor.step import train_step
from executor.styles import register_style
from executor.train import TrainResult, train  # binds executor.train to the function
from executor.transformer_styles import full_parameters

__all__ = ["Drift", "PlanMismatch", "RankBatch", "StepMonitor", "TrainResult",
           "check_step_time", "full_parameters", "parallelize", "register_style",
           "shard_batch", "shard_keywords", "train", "train_step"]

"""A plan in the forms torchtitan and Megatron-LM run, and their job files read back."""

from planner.export.config import Departure, Expressed, JobConfig, express, seq_len_of
from planner.export.megatron import read_megatron, to_megatron
from planner.export.torchtitan import JobFileError, read_torchtitan, to_torchtitan

__all__ = ["Departure", "Expressed", "JobConfig", "JobFileError", "express", "read_megatron",
           "read_torchtitan", "seq_len_of", "to_megatron", "to_torchtitan"]

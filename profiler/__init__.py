"""Trace a model and measure what each layer costs: the first step of hyplan's flow."""

from profiler.graph import Layer, ModelGraph, TensorMeta
from profiler.profile import profile
from profiler.trace import TraceError, fx_trace, trace

__all__ = ["Layer", "ModelGraph", "TensorMeta", "TraceError", "fx_trace", "profile", "trace"]

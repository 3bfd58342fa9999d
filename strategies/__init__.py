"""Devices, links, collective costs and the per-layer strategies with their costs."""

from strategies.catalog import (
    ChannelParallel,
    ColumnParallel,
    Cost,
    CostContext,
    DataParallel,
    FeatureParallel,
    Replicate,
    RowParallel,
    Strategy,
    candidates,
    register,
)
from strategies.cluster import Cluster
from strategies.experts import ExpertParallel
from strategies.devices import DEVICES, DeviceSpec, LinkSpec
from strategies.layouts import Layout
from strategies.parse import parse_devices
from strategies.rowwise import register_rowwise
from strategies.sequence import SequenceParallel, register_sequencewise
from strategies.transformer import (
    AttentionSpec, HeadParallel, VocabParallel, register_attention,
)

__all__ = [
    "DEVICES", "ChannelParallel", "Cluster", "ColumnParallel", "Cost", "CostContext",
    "DataParallel", "DeviceSpec", "ExpertParallel", "FeatureParallel", "Layout", "LinkSpec",
    "Replicate",
    "RowParallel", "Strategy", "candidates", "parse_devices", "register",
    "AttentionSpec", "HeadParallel", "VocabParallel", "register_attention", "register_rowwise",
    "SequenceParallel", "register_sequencewise",
]

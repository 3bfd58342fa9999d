"""What a user types for devices ("8xV100", "2x8xH100", "4xcpu", "2xprofile.json", 8, a
list of torch devices) -> a validated `Cluster`.

Apart from `cluster.py` because a local or measured device is read from a calibrated
profile (`strategies.calibrated`), which itself builds Clusters: the record below, the
profile above it, and this reader on top.
"""

from __future__ import annotations

import re

from strategies.calibrated import load_profile
from strategies.cluster import Cluster
from strategies.devices import DEVICES, INTER_NODE, INTRA_NODE, link_family
from strategies.profile_cache import local_profile

_PROFILE = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(.+\.json)\s*$", re.IGNORECASE)
_SPEC = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(?:(\d+)\s*x\s*)?([A-Za-z][\w.\-]*)\s*$")


def _named_cluster(count_a: int | None, count_b: int | None, name: str) -> Cluster:
    nodes, per_node = (count_a, count_b) if count_b is not None else (
        1, 1 if count_a is None else count_a)  # "0xV100" is zero devices, not one
    if nodes < 1 or per_node < 1:
        raise ValueError(f"devices: counts must be positive, got {nodes} nodes x {per_node}")
    if name.lower().endswith(".json"):
        return load_profile(name).cluster(per_node, nodes)
    if name.lower() == "cpu":  # this machine: its calibrated profile (made on first use)
        return local_profile(nodes * per_node, "cpu").cluster(per_node, nodes)
    key = next((k for k in DEVICES if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(
            f"devices: unknown device {name!r}; known: {', '.join(sorted(DEVICES))}, cpu "
            f"(or pass a strategies.Cluster for another device)"
        )
    family = link_family(key)
    return Cluster(device=DEVICES[key], nodes=nodes, devices_per_node=per_node,
                   intra_node=INTRA_NODE[family], inter_node=INTER_NODE[family])


def parse_devices(devices) -> Cluster:
    """Read a device description: "8xV100", "2x8xH100" (nodes x per node), "4xcpu", "H100",
    an int (that many local devices), a list of torch devices, or a Cluster. "Nxcpu" and
    local devices (an int, a list) are this machine, priced with its calibrated profile
    (`strategies.profile_cache`: measured on first use, then cached); a named GPU ("8xH100")
    is priced from the catalog, as it may be another machine."""
    if isinstance(devices, Cluster):
        return devices
    if isinstance(devices, bool):
        raise ValueError(f"devices: expected a device string, count or Cluster, got {devices!r}")
    if isinstance(devices, int):
        return _local(devices)
    if isinstance(devices, str):
        profile = _PROFILE.match(devices)
        if profile:  # "[COUNTx]path/to/profile.json": a cluster measured by `hyplan calibrate`
            count, path = profile.groups()
            return _named_cluster(int(count) if count else None, None, path)
        match = _SPEC.match(devices)
        if not match:
            raise ValueError(
                f"devices: cannot read {devices!r}; write COUNTxNAME or NODESxCOUNTxNAME, "
                f"e.g. '8xV100', '2x8xH100', '4xcpu'"
            )
        a, b, name = match.groups()
        return _named_cluster(int(a) if a else None, int(b) if b else None, name)
    if isinstance(devices, (list, tuple)):
        import torch

        kinds = {torch.device(d).type for d in devices}
        if len(kinds) != 1:
            raise ValueError(f"devices: all devices must be of one type, got {sorted(kinds)}")
        return _local(len(devices), kinds.pop())
    raise ValueError(
        f"devices: expected a string like '8xV100', an int, a list of torch devices or a "
        f"Cluster, got {type(devices).__name__}"
    )


def _local(count: int, kind: str | None = None) -> Cluster:
    """`count` devices of this machine: its GPUs if it has that many, else CPU processes."""
    import torch

    if count < 1:
        raise ValueError(f"devices: the device count must be at least 1, got {count}")
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= count:
        # this machine's GPUs: their calibrated profile (CUDA events), made on first use
        return local_profile(count, "cuda").cluster(count, 1)
    if kind == "cuda":
        raise ValueError(f"devices: {count} CUDA devices asked for, this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    return _named_cluster(count, None, "cpu")

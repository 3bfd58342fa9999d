"""The Plan: what to run where, what it is predicted to cost, and how sure the solver is.

A Plan is data (pydantic), so it can be saved, read by other tools and checked before
anything runs. Field names under `layers`, `mesh`, `predicted` and `solver` are a stable
interface: tools outside hyplan read them. Bump SCHEMA_VERSION when they change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strategies.cluster import Cluster

SCHEMA_VERSION = 1


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerPlan(_Data):
    """One layer's decision and its predicted cost per device per step."""

    name: str = Field(description="module path (e.g. 'classifier.1'), or the fx node name")
    node: str = Field(description="the torch.fx node name the executor matches")
    kind: str = Field(description="module class or function name")
    output_shape: list[int] = Field(description="global shape of the layer's output")
    strategy: str
    input_layout: str
    output_layout: str
    model_parallel: bool = False
    compute_s: float
    communication_s: float = Field(description="collectives the layer issues itself")
    update_s: float = 0.0
    reshard_in_s: float = Field(0.0, description="layout changes on the edges into it")
    memory_bytes: float
    param_bytes: int
    reason: str = ""


class InputPlan(_Data):
    """A model input: `batch` means each rank passes its rows, `replicate` all of them."""

    name: str
    layout: str
    shape: list[int]


class MeshPlan(_Data):
    """The device mesh: a 1-D group of all devices, which each layer uses data- or
    model-parallel."""

    shape: list[int]
    dim_names: list[str]
    device_type: str
    nodes: int
    devices_per_node: int


class Predicted(_Data):
    step_time_s: float
    compute_s: float
    communication_s: float
    other_s: float = Field(description="the optimizer's update")
    fixed_s: float = Field(0.0, description="per-step cost of the distributed engine itself, "
                           "the same for every plan (hyplan calibrate measures it)")
    memory_bytes: list[float] = Field(description="one entry per device")
    memory_limit_bytes: float
    data_parallel_step_time_s: float | None = None
    single_device_step_time_s: float | None = None
    # each hand-written baseline's predicted step time ("ddp", "tensor", ...), same model
    baseline_step_time_s: dict[str, float] = Field(default_factory=dict)

    @property
    def speedup_over_data_parallel(self) -> float | None:
        t = self.data_parallel_step_time_s
        return t / self.step_time_s if t else None

    @property
    def speedup_over_single_device(self) -> float | None:
        t = self.single_device_step_time_s
        return t / self.step_time_s if t else None


class SolverReport(_Data):
    status: str
    objective_s: float
    bound_s: float
    seconds: float
    backend: str
    num_variables: int = 0
    num_constraints: int = 0
    planning_seconds: float = 0.0


class PlanFileError(ValueError):
    """A plan file that cannot be read: not JSON, another schema, or a bad field."""


class Plan(_Data):
    schema_version: Literal[1] = SCHEMA_VERSION
    model: str
    fingerprint: str = Field(description="of the traced model; the executor checks it")
    global_batch: int = Field(gt=0)
    optimizer: str
    cluster: Cluster
    mesh: MeshPlan
    inputs: list[InputPlan]
    layers: list[LayerPlan]
    predicted: Predicted
    solver: SolverReport

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    def layer(self, name: str) -> LayerPlan:
        for layer in self.layers:
            if layer.name == name or layer.node == name:
                return layer
        raise KeyError(f"no layer {name!r} in the plan; layers: {[l.name for l in self.layers]}")

    def explain(self) -> str:
        """The dry run in words and a table: nothing executes."""
        from planner.explain import explain

        return explain(self)

    # --- files ------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFileError(f"plan: not valid JSON ({error}); re-create it with "
                                f"`hyplan plan ... --json FILE`") from None
        if isinstance(data, dict) and data.get("schema_version") not in (None, SCHEMA_VERSION):
            raise PlanFileError(f"plan: schema_version {data.get('schema_version')!r} is not "
                                f"{SCHEMA_VERSION}; re-create the plan with this hyplan")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise PlanFileError(f"plan: field {field!r}: {first['msg']}; re-create the plan "
                                f"with `hyplan plan ... --json FILE`") from None

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (a crash never leaves half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

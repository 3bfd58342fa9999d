"""The kernel-level levers torchtitan and Megatron-LM jobs turn, as one option on a Cluster.

Each lever changes what a step's kernels cost, not what a plan computes: torch.compile
fuses element-wise and normalization work (strategies.fusion), float8 runs the Linear
GEMMs on FP8 tensor cores with casts and scales around them (strategies.float8), and
asynchronous tensor parallelism overlaps the tensor-parallel all-gathers and
reduce-scatters with the matmuls beside them (strategies.async_tp). All off by default,
so a cluster that does not ask prices every step exactly as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

# torchao's float8 training recipes (torchao.float8.Float8LinearConfig.from_recipe_name)
FLOAT8_RECIPES = ("tensorwise", "rowwise")


class Levers(BaseModel):
    """Which kernel levers the priced configuration turns on."""

    model_config = ConfigDict(frozen=True)

    compile: bool = False  # torch.compile of each transformer block (torchtitan's)
    float8: str | None = None  # None, "tensorwise" or "rowwise" (torchao's recipes)
    async_tp: bool = False  # micro-pipelined tensor parallelism (torch's async TP)
    # tensor parallelism as torchtitan runs it (its apply_tp's SequenceParallel norms,
    # Shard(1) block outputs): norms and residual adds on each rank's sequence shard,
    # offered on torch.export graphs too, where hyplan's own executor runs them whole
    # (planner.offers): a priced configuration, not one hyplan runs
    sequence_parallel: bool = False
    # the loss on each rank's vocabulary shard of a vocabulary-split head (torchtitan's
    # loss_parallel, on with its TP; Megatron-LM's vocab-parallel cross-entropy): no
    # gather of the logits, 1/tp of the loss's tensors on a rank. Priced only: hyplan's
    # executor hands the logits back whole (planner.handback)
    loss_parallel: bool = False

    @field_validator("float8")
    @classmethod
    def _recipe_known(cls, value):
        if value is not None and value not in FLOAT8_RECIPES:
            raise ValueError(f"float8: {value!r} is not a torchao recipe; use one of "
                             f"{', '.join(FLOAT8_RECIPES)} or None")
        return value

    @property
    def any(self) -> bool:
        return (self.compile or self.float8 is not None or self.async_tp
                or self.sequence_parallel or self.loss_parallel)

    def describe(self) -> str:
        """The levers on, in words ("eager" when none)."""
        on = (["torch.compile"] if self.compile else []) + (
            [f"float8 {self.float8}"] if self.float8 else []) + (
            ["async TP"] if self.async_tp else []) + (
            ["sequence parallel"] if self.sequence_parallel else []) + (
            ["loss parallel"] if self.loss_parallel else [])
        return " + ".join(on) or "eager"

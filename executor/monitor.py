"""Close the loop: time the first steps of a real run, layer by layer, against the plan's
prediction; refit the cost model from what was measured; say when the run strays.

    model = executor.parallelize(model, plan)
    monitor = executor.StepMonitor(model, plan)
    for step in range(steps):
        with monitor.step():
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    drift = monitor.drift()                  # measured against predicted, per layer and step
    if drift.strays(0.25):
        print(drift.message())               # and, with the model: drift.replan(model, inputs)

Each planned layer that is a module (and each `Reshard` the executor inserted) is timed in
forward and backward with module hooks; what is left of a step (gradient all-reduces of the
data-parallel layers, the optimizer, the loss, functional ops) is timed as the remainder.
The refit keeps the calibrated link shapes and rescales two things, compute and
communication, by measured over predicted: enough to re-solve with the run's own figures.
Hooks add a little time per module, so the monitor times only the first `steps` steps and
then removes them.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from planner.plan import Plan
from strategies.cluster import Cluster
from strategies.devices import CollectiveFit, LinkSpec


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fx GraphModule's own submodules by qualified name (under DDP, its `module`)."""
    inner = getattr(model, "module", model)
    return dict(inner.named_modules())


@dataclass
class Drift:
    """Measured against predicted for the first steps of a run (seconds per step)."""

    plan: Plan
    step_s: float  # measured: median over the timed steps
    layer_s: dict[str, float]  # measured forward + backward per planned layer (module name)
    reshard_s: float  # measured in the executor's Reshard modules
    rest_s: float  # the remainder: DP all-reduces, optimizer, loss, functional ops
    steps: int
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_s(self) -> float:
        return self.plan.predicted.step_time_s

    @property
    def ratio(self) -> float:
        return self.step_s / self.predicted_s

    def strays(self, threshold: float = 0.25) -> bool:
        """True when the measured step time is off the prediction by more than `threshold`
        (relative to the prediction)."""
        return abs(self.ratio - 1) > threshold

    def factors(self) -> tuple[float, float]:
        """(compute, communication): measured over predicted, for the refit. Compute is
        what the timed layers took against their predicted compute (and the collectives
        model-parallel layers issue inside themselves); communication is the rest of the
        step against the predicted layout changes and gradient all-reduces."""
        layers = {l.name: l for l in self.plan.layers}
        timed = [layers[n] for n in self.layer_s if n in layers]
        predicted_compute = sum(l.compute_s + (l.communication_s if l.model_parallel else 0.0)
                                for l in timed)
        untimed_compute = sum(l.compute_s for l in self.plan.layers if l.name not in self.layer_s)
        compute = (sum(self.layer_s.values()) / predicted_compute) if predicted_compute else 1.0
        predicted_comm = (sum(l.reshard_in_s for l in self.plan.layers)
                          + sum(l.communication_s for l in self.plan.layers
                                if not l.model_parallel))
        measured_comm = (self.reshard_s + self.rest_s - self.plan.predicted.other_s
                         - untimed_compute * compute)
        comm = measured_comm / predicted_comm if predicted_comm > 1e-6 else 1.0
        return max(compute, 0.05), max(comm, 0.05)

    def refit(self, cluster: Cluster | None = None) -> Cluster:
        """The plan's cluster with compute and every collective rescaled by `factors()`."""
        cluster = cluster or self.plan.cluster
        compute, comm = self.factors()

        def scaled(link: LinkSpec) -> LinkSpec:
            names = set(link.collectives) | {"all_reduce", "all_gather", "reduce_scatter",
                                             "all_to_all", "send_recv"}
            fits = {}
            for name in names:
                alpha, beta = link.alpha_beta(name)
                fits[name] = CollectiveFit(latency_s=alpha * comm,
                                           bandwidth_bytes_per_s=beta / comm)
            return link.model_copy(update={
                "collectives": fits, "latency_s": link.latency_s * comm,
                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s / comm,
                "source": f"{link.source}; refit from a run (x{comm:.2f})"})

        return cluster.model_copy(update={
            "compute_slowdown": cluster.compute_slowdown * compute,
            "dtensor_layer_overhead_s": cluster.dtensor_layer_overhead_s * compute,
            "dtensor_reshard_overhead_s": cluster.dtensor_reshard_overhead_s * comm,
            "intra_node": scaled(cluster.intra_node),
            "inter_node": scaled(cluster.inter_node),
        })

    def message(self) -> str:
        compute, comm = self.factors()
        return (f"hyplan: measured step {self.step_s * 1e3:.1f} ms against predicted "
                f"{self.predicted_s * 1e3:.1f} ms ({self.ratio:.2f}x, median of {self.steps} "
                f"steps); compute ran {compute:.2f}x and communication {comm:.2f}x the "
                f"model's figures")

    def replan(self, model: nn.Module, example_inputs, **optimize_kwargs) -> tuple[Plan, bool]:
        """(the plan re-solved on the refit cluster, whether any layer's strategy changed).
        `model` is the original (unparallelized) model, `example_inputs` the global batch."""
        from planner.optimize import optimize

        optimize_kwargs.setdefault("optimizer", self.plan.optimizer)
        new = optimize(model, self.refit(), example_inputs=example_inputs, **optimize_kwargs)
        old = {l.name: l.strategy for l in self.plan.layers}
        changed = any(old.get(l.name) != l.strategy for l in new.layers)
        return new, changed


class StepMonitor:
    """Times the first `steps` steps of a parallelized model, per layer, against its plan."""

    def __init__(self, model: nn.Module, plan: Plan, steps: int = 5, skip: int = 2):
        self.plan, self.steps, self.skip = plan, steps, skip
        self._seen = 0
        self._step_times: list[float] = []
        self._layer_times: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._handles = []
        planned = {l.name for l in plan.layers}
        for name, module in _modules(model).items():
            if name in planned or name.startswith("hyplan_reshard_"):
                self._hook(name, module)

    def _hook(self, name: str, module: nn.Module) -> None:
        starts: dict[str, float] = {}

        def pre(*_):
            starts["f"] = time.perf_counter()

        def post(*_):
            self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - starts["f"]

        def bwd_pre(*_):
            starts["b"] = time.perf_counter()

        def bwd_post(*_):
            if "b" in starts:
                self._current[name] = (self._current.get(name, 0.0)
                                       + time.perf_counter() - starts.pop("b"))

        self._handles += [module.register_forward_pre_hook(pre),
                          module.register_forward_hook(post),
                          module.register_full_backward_pre_hook(bwd_pre),
                          module.register_full_backward_hook(bwd_post)]

    @property
    def done(self) -> bool:
        return len(self._step_times) >= self.steps

    @contextmanager
    def step(self):
        """Wrap one training step (forward, backward, optimizer step)."""
        if self.done:
            yield
            return
        self._current = {}
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        self._seen += 1
        if self._seen > self.skip:  # the first steps warm up allocators and connections
            self._step_times.append(elapsed)
            self._layer_times.append(self._current)
        if self.done:
            self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def drift(self) -> Drift:
        if not self._step_times:
            raise RuntimeError("StepMonitor: no step timed yet; wrap steps in `with "
                               "monitor.step():`")
        i = sorted(range(len(self._step_times)), key=self._step_times.__getitem__)[
            len(self._step_times) // 2]  # the median step, with its own layer times
        layers = self._layer_times[i]
        reshard = sum(t for n, t in layers.items() if n.startswith("hyplan_reshard_"))
        planned = {n: t for n, t in layers.items() if not n.startswith("hyplan_reshard_")}
        step = self._step_times[i]
        rest = max(0.0, step - sum(layers.values()))
        return Drift(self.plan, step, planned, reshard, rest, len(self._step_times),
                     notes=[f"median of {statistics.median(self._step_times) * 1e3:.1f} ms"])


def check_step_time(plan: Plan, step_s: float, threshold: float = 0.25) -> str | None:
    """A warning when a measured step time strays from the plan's prediction by more than
    `threshold` (relative), else None: the check a training loop runs without hooks."""
    ratio = step_s / plan.predicted.step_time_s
    if abs(ratio - 1) <= threshold:
        return None
    return (f"hyplan: measured step {step_s * 1e3:.1f} ms is {ratio:.2f}x the predicted "
            f"{plan.predicted.step_time_s * 1e3:.1f} ms (threshold {threshold:.0%}); re-run "
            f"`hyplan calibrate` on this machine, or use executor.StepMonitor to refit and "
            f"re-plan")

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
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from planner.once import planning_alone
from planner.plan import Plan
from strategies.cluster import Cluster
from strategies.devices import CollectiveFit, LinkSpec


UPDATE = "\0optimizer"  # the optimizer's step in a step's timings (no module has this name)


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fx GraphModule's own submodules by qualified name (under DDP, its `module`)."""
    inner = getattr(model, "module", model)
    return dict(inner.named_modules())


# the least share of the predicted step a term (compute, communication) needs for its
# measured/predicted ratio to rescale the cost model
MIN_TERM_SHARE = 0.02


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
    update_s: float | None = None  # the optimizer's step, where the monitor was handed it

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
        # a term predicted at a sliver of the step is not rescaled: its measured share holds
        # hook overheads and noise of the same size (a plan whose timed layers are priced
        # at microseconds would read "compute ran 666x")
        floor_s = MIN_TERM_SHARE * self.predicted_s
        compute = (sum(self.layer_s.values()) / predicted_compute
                   if predicted_compute > floor_s else 1.0)
        predicted_comm = (sum(l.reshard_in_s for l in self.plan.layers)
                          + sum(l.communication_s for l in self.plan.layers
                                if not l.model_parallel))
        measured_comm = (self.reshard_s + self.rest_s - self.plan.predicted.other_s
                         - untimed_compute * compute)
        comm = measured_comm / predicted_comm if predicted_comm > max(floor_s, 1e-6) else 1.0
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
                fit = link.collectives.get(name) or CollectiveFit(
                    latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s)
                # DTensor's cost per tensor-parallel layer is priced as the layer's compute
                k = compute if name == "tp_layer" else comm
                fits[name] = CollectiveFit(
                    latency_s=fit.latency_s * k,
                    bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s / k,
                    regimes=tuple(r.model_copy(update={
                        "latency_s": r.latency_s * k,
                        "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s / k})
                        for r in fit.regimes))
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

    def terms(self) -> list[tuple[str, float, float]]:
        """(term, predicted seconds, measured seconds) per part of the step, summing to the
        predicted and the measured step: the planned layers (their compute and the
        collectives model-parallel layers issue inside them), the layout changes between
        layers, the optimizer's update (where timed), and the rest (data-parallel gradient
        sync, the loss, untimed ops, the engine's fixed cost, a pipeline's bubble)."""
        p = self.plan.predicted
        timed = [l for l in self.plan.layers if l.name in self.layer_s]
        layers = sum(l.compute_s + (l.communication_s if l.model_parallel else 0.0)
                     for l in timed)
        reshard = sum(l.reshard_in_s for l in self.plan.layers)
        update = p.other_s if self.update_s is not None else 0.0
        out = [("layers (compute)", layers, sum(self.layer_s.values())),
               ("layout changes", reshard, self.reshard_s)]
        if self.update_s is not None:
            out.append(("optimizer update", update, self.update_s))
        predicted_rest = p.step_time_s - layers - reshard - update
        out.append(("gradient sync and rest", predicted_rest,
                    self.rest_s - (self.update_s or 0.0)))
        return out

    def message(self) -> str:
        compute, comm = self.factors()
        lines = [f"hyplan: measured step {self.step_s * 1e3:.1f} ms against predicted "
                 f"{self.predicted_s * 1e3:.1f} ms ({self.ratio:.2f}x, median of {self.steps} "
                 f"steps); compute ran {compute:.2f}x and communication {comm:.2f}x the "
                 f"model's figures"]
        lines.append(f"  {'term':<24}{'predicted':>11}{'measured':>11}{'drift':>10}")
        for term, predicted, measured in self.terms():
            drift = f"{(measured - predicted) * 1e3:+.1f} ms"
            lines.append(f"  {term:<24}{predicted * 1e3:>8.1f} ms{measured * 1e3:>8.1f} ms"
                         f"{drift:>10}")
        return "\n".join(lines)

    def replan(self, model: nn.Module, example_inputs, **optimize_kwargs) -> tuple[Plan, bool]:
        """(the plan re-solved on the refit cluster, whether any layer's strategy changed).
        `model` is the original (unparallelized) model, `example_inputs` the global batch."""
        from planner.optimize import optimize

        optimize_kwargs.setdefault("optimizer", self.plan.optimizer)
        with planning_alone():  # one rank re-plans; the others are not in this call
            new = optimize(model, self.refit(), example_inputs=example_inputs, **optimize_kwargs)
        old = {l.name: l.strategy for l in self.plan.layers}
        changed = any(old.get(l.name) != l.strategy for l in new.layers)
        return new, changed


    def replan_report(self, model: nn.Module, example_inputs, **optimize_kwargs
                      ) -> tuple[Plan, str]:
        """(the re-solved plan, one line on what it would gain): the plan re-solved on the
        refit cluster against this plan re-priced there (its strategies pinned), both on
        the figures this run measured."""
        from planner.optimize import optimize

        new, changed = self.replan(model, example_inputs, **optimize_kwargs)
        if not changed:
            return new, (f"hyplan: re-planned on the measured figures: the same strategies "
                         f"stay the best ({new.predicted.step_time_s * 1e3:.1f} ms predicted)")
        optimize_kwargs.setdefault("optimizer", self.plan.optimizer)
        pinned = {l.name: l.strategy for l in self.plan.layers}
        with planning_alone():
            same = optimize(model, self.refit(), example_inputs=example_inputs, pin=pinned,
                            **optimize_kwargs).predicted.step_time_s
        t = new.predicted.step_time_s
        moved = sum(pinned.get(l.name) != l.strategy for l in new.layers)
        return new, (f"hyplan: re-planned on the measured figures: {t * 1e3:.1f} ms predicted "
                     f"against {same * 1e3:.1f} ms for this plan ({same / t:.2f}x, {moved} "
                     f"layer(s) change strategy)")


class StepMonitor:
    """Times the first `steps` steps of a parallelized model, per layer, against its plan."""

    def __init__(self, model: nn.Module, plan: Plan, steps: int = 5, skip: int = 2,
                 optimizer=None):
        self.plan, self.steps, self.skip = plan, steps, skip
        self._seen = 0
        self._step_times: list[float] = []
        self._layer_times: list[dict[str, float]] = []
        self._update_times: list[float] = []
        self._current: dict[str, float] = {}
        self._handles = []
        planned = {l.name for l in plan.layers}
        for name, module in _modules(model).items():
            if name in planned or name.startswith("hyplan_reshard_"):
                self._hook(name, module)
        self._timed_update = optimizer is not None
        if optimizer is not None:  # the update is its own term of the prediction
            began = {}

            def step_pre(*_):
                began["t"] = time.perf_counter()

            def step_post(*_):
                if "t" in began:
                    self._current[UPDATE] = (self._current.get(UPDATE, 0.0)
                                             + time.perf_counter() - began.pop("t"))

            self._handles += [optimizer.register_step_pre_hook(step_pre),
                              optimizer.register_step_post_hook(step_post)]

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
        with warnings.catch_warnings():
            # the first layer's input needs no gradient; its backward hook still times it
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
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
        layers = dict(self._layer_times[i])
        update = layers.pop(UPDATE, 0.0)
        reshard = sum(t for n, t in layers.items() if n.startswith("hyplan_reshard_"))
        planned = {n: t for n, t in layers.items() if not n.startswith("hyplan_reshard_")}
        step = self._step_times[i]
        rest = max(0.0, step - sum(layers.values()))
        return Drift(self.plan, step, planned, reshard, rest, len(self._step_times),
                     notes=[f"median of {statistics.median(self._step_times) * 1e3:.1f} ms"],
                     update_s=update if self._timed_update else None)


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

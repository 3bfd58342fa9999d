"""torchtitan's Llama 3.1 8B and 70B runs with torch.compile, float8 and async TP, priced beside
the published tokens/s per GPU.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/titan_levers.py \
        [titan8 titan128 titan70 titan8tp]

8B: benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3. 70B: torchtitan's
benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (FSDP 32 x TP 8 on 256 H100, local
batch 16, seq 8192, full AC, torch.compile on every row; bf16 597, async TP 652, float8
tensorwise 810, float8 + async TP 942 tokens/s/GPU, as issue 39 quotes them from its
table; and its 8B on 64 H100, FSDP 8 x TP 8, local batch 12: 4378 -> 4809 with async TP,
float8 tensorwise 5078 -> 5570, rowwise 3709 -> 3915), priced through the planner's own
"fsdp_tp" baseline (planner.baseline.fsdp_tp
at tp 8: the search picks each layer's TP strategy and the blocks it recomputes), the
float8 rowwise rows of the same table beside them. Float8 tensorwise's float8 TP
all-gathers, its casts on the sequence shard (strategies.float8.cast_bytes) and async TP
are priced in the plan's price list (planner.price, the lever terms on TP collectives:
strategies.float8.tp_gather_bytes, strategies.async_tp). torchtitan's sequence-parallel
norms are priced as it runs them (Levers.sequence_parallel): with them, and attention on
meta priced as the fused kernel saves (profiler.meta_attention), the 70B's plan fits in
8 microbatches of 2 rows (torchtitan runs one of 16: its recv buffers and FSDP gathers are
priced per microbatch).

Each row is torchtitan's configuration as it ran (FSDP on every layer with weights, local
batch 2, seq 8192, bf16, selective activation checkpointing; benchmarks/gpu_model_check.py's
`price_fsdp`, the same costs every plan reads), on a cluster whose `levers`
(strategies.kernel_levers) turn torch.compile (strategies.fusion) and float8 tensorwise
with float8 all-gathers (strategies.float8) on. Term by term, so an error can be read
where it lies. Nothing here runs on a GPU.
"""

from __future__ import annotations

import sys
import time

from gpu_model_check import RUNS, bf16, fsdp_priced

from planner.baseline import fsdp_tp
from planner.plan import EVERY_BLOCK
from planner.profiled import profiled_graph
from planner.report.throughput import plan_throughput
from profiler.presets import load_llm
from strategies.kernel_levers import Levers
from strategies.parse import parse_devices

# (levers, published tokens/s/GPU on 8 and on 128 GPUs), torchtitan tables 1 and 3
ROWS = [
    (Levers(), {"titan8": 5762, "titan128": 5605}),
    (Levers(compile=True), {"titan8": 6667, "titan128": 6514}),
    (Levers(compile=True, float8="tensorwise"), {"titan8": 8532, "titan128": 8380}),
]
# not in torchtitan's tables: rowwise beside tensorwise (torchtitan commit 7a04053 measured
# rowwise 11.5% and tensorwise 24.8% over compiled bf16 on 8 GPUs)
ROWWISE = Levers(compile=True, float8="rowwise")


def price(run_name: str, levers: Levers, model_inputs):
    """(step seconds, {term: seconds}) of torchtitan's FSDP run with `levers` on."""
    model, inputs, kwargs = model_inputs
    cluster = bf16(RUNS[run_name].devices).model_copy(update={"levers": levers})
    graph, cluster = profiled_graph(model, cluster, inputs, kwargs)
    return fsdp_priced(graph, cluster)


# torchtitan's async TP table (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): per
# job, (levers, published without async TP, with it), float8 rowwise included
ROWS_ASYNC = [(Levers(compile=True), {"titan70": (597.3, 652.4), "titan8tp": (4378, 4809.4)}),
              (Levers(compile=True, float8="tensorwise"),
               {"titan70": (809.8, 942.4), "titan8tp": (5078.1, 5570.1)}),
              (Levers(compile=True, float8="rowwise"),
               {"titan70": (599.6, 624.8), "titan8tp": (3708.5, 3914.9)})]
# (model, devices, global batch: local batch x FSDP degree, what torchtitan checkpointed)
TP_JOBS = {"titan70": ("llama3-70b", "32x8xH100-96GB", 16 * 32, "full AC"),
           "titan8tp": ("llama3-8b", "8x8xH100-96GB", 12 * 8, "per-op SAC")}
TP = 8


def price_tp(devices: str, levers: Levers, loaded):
    """torchtitan's FSDP x TP 8 plan on `devices` with `levers` (float8 tensorwise's TP
    gathers and async TP priced in the plan: planner.price's lever terms), and its TP
    layers' own collectives (their FSDP collectives included)."""
    model, inputs, kwargs = loaded[:3]
    # torchtitan's apply_tp runs every block sequence parallel (Levers.sequence_parallel)
    levers = levers.model_copy(update={"sequence_parallel": True})
    cluster = parse_devices(devices).model_copy(update={"levers": levers})
    graph, cluster = profiled_graph(model, cluster, inputs, kwargs, tracer="blocks")
    plan = fsdp_tp(graph, cluster, "adam", cluster.device.memory_bytes, time.perf_counter(),
                   tp=TP)
    return plan, sum(l.communication_s for l in plan.layers if l.model_parallel)


def main_tp(name: str) -> None:
    model_name, devices, batch, ac = TP_JOBS[name]
    loaded = load_llm(model_name, batch, 8192)
    shape, seq = loaded[3], loaded[4]
    dp = parse_devices(devices).num_devices // TP
    print(f"== torchtitan {model_name}, FSDP {dp} x TP {TP}, {devices}, seq 8192, global "
          f"batch {batch}, {ac} in torchtitan (hyplan's fsdp_tp picks the recomputed blocks)")
    for base, published in ROWS_ASYNC:
        plain, with_async = published[name]
        for levers, figure in ((base, plain),
                               (base.model_copy(update={"async_tp": True}), with_async)):
            started = time.perf_counter()
            plan, tp_comm_s = price_tp(devices, levers, loaded)
            p = plan.predicted
            tps = plan_throughput(plan, shape, seq).tokens_per_s_per_device
            print(f"  {levers.describe():<44s} step {p.step_time_s:7,.2f} s  {tps:7,.0f} "
                  f"tokens/s/GPU  (published {figure:,}: {tps / figure - 1:+.1%}; priced "
                  f"in {time.perf_counter() - started:.0f} s)")
            recomputed = (shape.layers if EVERY_BLOCK in plan.recompute_blocks
                          else len(plan.recompute_blocks))
            edges_s = sum(l.reshard_in_s for l in plan.layers)
            print(f"     compute {p.compute_s:.2f} s, communication {p.communication_s:.2f} "
                  f"s (TP layers' own {tp_comm_s:.2f} s, edges {edges_s:.2f} s), blocks "
                  f"recomputed: {recomputed} of {shape.layers}, {plan.microbatches} "
                  f"microbatch(es)")
    print()


def main(names: list[str]) -> None:
    for name in (n for n in names if n in TP_JOBS):
        main_tp(name)
    for name in (n for n in names if n not in TP_JOBS):
        run = RUNS[name]
        loaded = load_llm("llama3-8b", run.global_batch, run.seq)[:3]
        devices = bf16(run.devices).num_devices
        print(f"== torchtitan Llama 3.1 8B, FSDP {devices}, {run.devices}, seq {run.seq}, "
              f"global batch {run.global_batch}, selective AC")
        rows = [(levers, published[name]) for levers, published in ROWS] + [(ROWWISE, None)]
        for levers, published in rows:
            started = time.perf_counter()
            step_s, terms = price(name, levers, loaded)
            tps = run.global_batch * run.seq / step_s / devices
            against = f"published {published:,}: {tps / published - 1:+.1%}" if published \
                else "not published"
            print(f"  {levers.describe():<34s} step {step_s * 1e3:7,.0f} ms  "
                  f"{tps:7,.0f} tokens/s/GPU  ({against}; priced in "
                  f"{time.perf_counter() - started:.0f} s)")
            print("     " + ", ".join(f"{k.split(':')[0]} {v * 1e3:,.0f}"
                                      for k, v in terms.items()) + " ms")
        print()


if __name__ == "__main__":
    main(sys.argv[1:] or ["titan8", "titan128", "titan70", "titan8tp"])

"""The GPU compute model by shape against published per-device throughput, term by term.

    PYTHONPATH=$PWD python benchmarks/gpu_model_check.py            # every run
    PYTHONPATH=$PWD python benchmarks/gpu_model_check.py titan8     # one run

Each run is a published configuration, priced as it was run (not planned): hyplan's own
costs (strategies.catalog / gpu_compute / collectives, the same functions every plan
reads) for that mesh and those strategies, then predicted against published tokens/s per
GPU (torchtitan) or TFLOP/s per GPU (Megatron-LM, their own FLOP formula). The terms are
printed so the error can be read term by term: GEMMs (Linear layers), attention blocks,
memory-bound ops, collectives (on GPUs only what runs past the compute beside it:
strategies.overlap), the optimizer update, torchtitan's selective recompute and the
pipeline bubble.

Runs (sources in each entry):
- titan8:   torchtitan, Llama 3.1 8B, FSDP over 8 H100 (500 W, 96 GB HBM2e), bf16,
            seq 8192, local batch 2, selective activation checkpointing, no compile:
            5,762 tokens/s/GPU (benchmarks/llama3_h100_202412_torchtitan.md, table 1)
- titan128: the same on 128 H100 (16 nodes, 400 Gb/s RDMA per GPU): 5,605 (table 3)
- megatron39: Megatron-LM GPT 39.1 B (hidden 8192, 48 layers, 64 heads), TP 8 x PP 2 x
            DP 32 on 512 A100-80GB (Selene), seq 2048, batch 1536: 138 TFLOP/s per GPU
            (Narayanan et al., SC'21, arXiv 2104.04473, table 1)

Nothing here runs on a GPU; no GPU was lent to the session that wrote it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

from planner.choices import layer_choices
from planner.ilp import solve
from planner.profiled import profiled_graph
from planner.plan3d import to_plan
from planner.search import Shape, search
from profiler.presets import LLMShape, build_llm, llm_shape, load_llm
from strategies.cluster import Cluster
from strategies.parse import parse_devices

GEMM, ATTENTION, MEMORY = "GEMMs (Linear)", "attention blocks", "memory-bound ops"


@dataclass(frozen=True)
class Run:
    name: str
    title: str
    devices: str
    seq: int
    global_batch: int
    published: float
    unit: str  # "tokens/s/GPU" or "TFLOP/s/GPU"
    source: str


RUNS = {
    "titan8": Run("titan8", "torchtitan Llama 3.1 8B, FSDP 8, 8x H100 (500 W, 96 GB), bf16, "
                  "seq 8192, local batch 2, selective AC, no compile", "8xH100-96GB", 8192,
                  16, 5762, "tokens/s/GPU",
                  "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1"),
    "titan128": Run("titan128", "torchtitan Llama 3.1 8B, FSDP 128, 16x8 H100 (500 W, 96 GB), "
                    "bf16, seq 8192, local batch 2, selective AC, no compile",
                    "16x8xH100-96GB", 8192, 256, 5605, "tokens/s/GPU",
                    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 3"),
    "megatron39": Run("megatron39", "Megatron-LM GPT 39.1B (h 8192, 48 layers, 64 heads), "
                      "TP 8 x PP 2 x DP 32, 512 A100-80GB, seq 2048, batch 1536",
                      "64x8xA100-80GB", 2048, 1536, 138, "TFLOP/s/GPU",
                      "Narayanan et al. SC'21 (arXiv 2104.04473), table 1"),
}


def bf16(devices: str) -> Cluster:
    """The cluster at bf16 FLOP rates (mixed precision; memory and bytes stay as built)."""
    cluster = parse_devices(devices)
    return Cluster(**{**cluster.model_dump(), "dtype": "bfloat16"})


def term(layer) -> str:
    if layer.kind in ("Linear", "Conv1D") or "nf" in getattr(layer, "attrs", {}):
        return GEMM
    return ATTENTION if "Attention" in layer.kind else MEMORY


def fsdp_rule(layer, options):
    """torchtitan's FSDP: every layer with weights sharded, the others data parallel (the
    planner's "fsdp" baseline replicates those, which no FSDP run does)."""
    for name in ("fsdp", "data_parallel", "replicate"):
        kept = [s for s in options if s.name == name]
        if kept:
            return kept
    return options


def price_fsdp(run: Run):
    """(step seconds, {term: seconds}, graph seconds) of FSDP on every layer, as torchtitan
    runs it (fully_shard per block and on the whole model)."""
    model, inputs, kwargs, shape, _ = load_llm("llama3-8b", run.global_batch, run.seq)
    cluster = bf16(run.devices)
    t0 = time.perf_counter()
    graph, cluster = profiled_graph(model, cluster, inputs, kwargs)
    traced_s = time.perf_counter() - t0
    step_s, terms = fsdp_priced(graph, cluster)
    return step_s, terms, shape, traced_s


def fsdp_priced(graph, cluster):
    """(step seconds, {term: seconds}) of FSDP on every layer of a profiled graph, with
    torchtitan's selective checkpointing added (benchmarks/titan_levers.py prices the same
    with its kernel levers on the cluster)."""
    choices = layer_choices(graph, cluster, "adam", None, keep=fsdp_rule)
    solution = solve(choices.problem, 60.0)
    terms: Counter = Counter()
    for i, row in enumerate(choices.layers):
        cost = row.costs[solution.choice[i]]
        terms[term(row.layer)] += cost.compute_s
        terms["collectives (FSDP all-gather x2, reduce-scatter)"] += cost.communication_s
        terms["optimizer update"] += cost.update_s
    terms["layout changes (edges)"] = solution.objective_s - sum(terms.values())
    terms[RECOMPUTE] = selective_ac_s(choices.layers, solution.choice)
    return solution.objective_s + terms[RECOMPUTE], terms


RECOMPUTE = "selective AC: forward of every other mm, elementwise"


def selective_ac_s(rows, choice) -> float:
    """What torchtitan's op-level selective activation checkpointing recomputes in each
    transformer block's backward, by hyplan's own prices: it saves the outputs of matmuls
    (every other one: the rest are recomputed) and of flash attention, and recomputes every
    other op (torchtitan/distributed/activation_checkpoint.py, `_op_sac_save_list` and
    "recompute every second mm"). A layer's forward is its FLOP share of forward +
    backward. hyplan has no such lever (its recompute is per layer or block, all of it)."""
    total = 0.0
    for i, row in enumerate(rows):
        layer = row.layer
        if ".layers." not in layer.name or layer.is_input:
            continue
        kind = term(layer)
        if kind == ATTENTION:
            continue
        flops = layer.fwd_flops + layer.bwd_flops
        forward = row.costs[choice[i]].compute_s * (layer.fwd_flops / flops if flops else 1 / 3)
        total += forward / 2 if kind == GEMM else forward
    return total


def megatron_flops_per_step(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM's count with full activation recomputation (Narayanan et al. 2021, eq. 3):
    96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def price_megatron(run: Run):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=48, n_embd=8192, n_head=64, n_positions=2048, vocab_size=51200,
                        tie_word_embeddings=True)
    model, inputs, kwargs = build_llm(config, run.global_batch, run.seq)
    shape = llm_shape(model, config, "gpt-39b")
    cluster = bf16(run.devices)
    t0 = time.perf_counter()
    graph, cluster = profiled_graph(model, cluster, inputs, kwargs)
    traced_s = time.perf_counter() - t0
    # Megatron's 39 B run: TP 8, PP 2, DP 32, microbatch of 2 rows (1536 / 32 / 24)
    result = search(graph, cluster, "adam", None, only=[Shape(2, 32, 8, 24, "1F1B")],
                    time_limit_s=120.0)
    p = to_plan(graph, cluster, "adam", float("inf"), result, 0.0).predicted
    terms: Counter = Counter()
    for layer in to_plan(graph, cluster, "adam", float("inf"), result, 0.0).layers:
        if layer.stage == 0:  # the stages are balanced; stage 0's terms, all microbatches
            terms[term(layer)] += layer.compute_s
    terms["collectives (TP, p2p, DP gradient sync; stage 0)"] = p.communication_s
    terms["pipeline bubble"] = p.bubble_s
    terms["optimizer update"] = p.other_s
    terms["(compute of the slowest stage)"] = p.compute_s
    flops = megatron_flops_per_step(run.global_batch, run.seq, 48, 8192, 51200)
    return (p.step_time_s, terms, shape, traced_s,
            flops / cluster.num_devices / p.step_time_s)


def check(name: str) -> None:
    run = RUNS[name]
    print(f"== {run.title}\n   published: {run.published:,} {run.unit} ({run.source})")
    if run.unit == "tokens/s/GPU":
        step_s, terms, shape, traced_s = price_fsdp(run)
        devices = bf16(run.devices).num_devices
        predicted = run.global_batch * run.seq / step_s / devices
    else:
        step_s, terms, shape, traced_s, rate = price_megatron(run)
        predicted = rate / 1e12
    print(f"   traced and profiled in {traced_s:.1f} s; priced step {step_s * 1e3:,.0f} ms:")
    for what, seconds in terms.items():
        print(f"     {what:<55s} {seconds * 1e3:9,.1f} ms")
    if run.unit == "tokens/s/GPU":
        published_step = run.global_batch * run.seq / run.published / devices
        print(f"   published step (from tokens/s): {published_step * 1e3:,.0f} ms")
    error = predicted / run.published - 1
    print(f"   predicted {predicted:,.0f} {run.unit} vs published {run.published:,}: "
          f"{error:+.1%}\n")


if __name__ == "__main__":
    for case in sys.argv[1:] or list(RUNS):
        check(case)

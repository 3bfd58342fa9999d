"""Megatron-Core's published mixture-of-experts runs (MoE Parallel Folding), imported from
Megatron-LM arguments, priced by hyplan with their expert parallelism, and hyplan's own
plan for each job beside them.

    PYTHONPATH=$PWD python benchmarks/megatron_moe_jobs.py [--runs mixtral-8x22b,qwen2-57b-a14b]
        [--variants written,fused,fused-selective] [--search-time S] [--no-own]

Each run is priced by planner.price_job (the 3-D search restricted to the job's shape,
every experts layer pinned to its EP group of ep ranks carved out of the stage's dp x tp
ranks: planner.price_job.expert_pin) in three variants (VARIANTS): as written; with
Megatron-Core's fused kernels as hyplan's compile lever (as benchmarks/megatron_jobs.py
prices Megatron-LM's); and with it and the unpublished recompute as selective (whole
blocks recomputed where memory needs them). Then hyplan's own 3-D plan (planner.optimize,
mesh "3d") for the same model, devices and batch with the last variant's kernel levers.

Source: Liu et al. 2025, "MoE Parallel Folding: Heterogeneous Parallelism Mappings for
Efficient Large-Scale MoE Model Training with Megatron Core", arXiv 2504.14960v2. Its
abstract's 49.3% MFU (Mixtral 8x22B) and 39.0% (Qwen2-57B-A14B) are the "MCore w/ Folding"
rows of Table 1 (global batch 256); appendix 6.4, Table 3 ("Detailed parallel mapping of
models with optimal configurations", global batch 256, sequence 4,096) gives their mapping:

    | Model          | Method           | GPUs | CP | TP | EP | PP | ETP | MFU   |
    | Mixtral-8x22B  | MCore w/ Folding |  128 |  1 |  2 |  8 |  8 |  1  | 49.3% |
    | Qwen2-57B-A14B | MCore w/ Folding |   64 |  1 |  2 |  4 |  4 |  1  | 39.0% |

Section 4.1: Eos, DGX H100 nodes of 8 H100 (989.5 TFLOP/s BF16 peak, NVLink 450 GB/s,
InfiniBand 400 Gb/s a GPU), PyTorch 2.5.0, CUDA 12.6, BF16; section 4.2: "token drop
training with a capacity factor equal to 1" (no dropless load imbalance); Table 2: the
Mixtral run at 487.7 TFLOP/s a GPU (= 49.3% of 989.5). Not published, and the value taken:
the micro-batch size (Megatron-LM's usual 1, the first tried; hyplan splits a microbatch's
rows over the tp ranks of an EP group, so where 1 row does not run the fewest more rows
that do are priced and said), virtual pipeline stages (none: Table 3 has no VPP column),
activation recompute (none, Megatron-LM's default), the distributed optimizer (on: the
Megatron-Core MoE recipes' and the baseline "TP+EP+DP" the paper describes as ZeRO-1),
sequence parallel (on: Megatron-Core requires it with tp and ep), the grouped GEMM and
the all-to-all dispatcher (on: read and passed over, planner.export.megatron.MOE_IGNORED).

MFU counts the FLOPs Megatron-LM logs (the paper prints no formula): megatron/training/
training.py `num_floating_point_operations` of its MoE releases before the causal-mask
halving, 12·B·s·L·h²·[(1 + g/a + s/h)·q/h + (f_moe/h)·k·3/2 + (f_shared/h)·3/2 + V/(2Lh)],
over step time x GPUs x 989.5 TFLOP/s; beside it hyplan's own count (6 x active
parameters + attention, profiler.presets.LLMShape.flops_per_token).

The models: Hugging Face's, on meta. Mixtral 8x22B as profiler.presets' "mixtral-8x22b"
(mistral-community/Mixtral-8x22B-v0.1 config.json: vocabulary 32,000; the Instruct
model's 32,768 moves the FLOPs by 0.05%); Qwen2-57B-A14B from Qwen/Qwen2-57B-A14B
config.json (hidden 3,584, 28 layers of 28 heads and 4 KV heads, 64 experts of 2,560, 8 a
token, a gated shared expert of 20,480, vocabulary 151,936).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, replace

import planner
from megatron_jobs import differs
from planner.export import read_megatron
from profiler.presets import PRESETS, build_llm, llm_shape
from strategies.experts import parse_name
from torchtitan_jobs import describe, fits

PEAK = 989.5e12  # the paper's BF16 peak per H100 (section 4.1)
GPUS_PER_NODE = 8  # DGX H100
SEQ, GBS = 4096, 256  # Table 3's runs (appendix 6.4)

# Qwen/Qwen2-57B-A14B config.json (its intermediate_size 18,944 is no layer's: every
# layer is MoE, decoder_sparse_step 1, mlp_only_layers [])
QWEN2_57B = dict(hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
                 shared_expert_intermediate_size=20480, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, num_experts=64,
                 num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1,
                 mlp_only_layers=[], vocab_size=151936, max_position_embeddings=131072,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass(frozen=True)
class Run:
    """One run of Table 3 and the model it trained."""

    key: str
    config: str  # transformers config class
    values: dict
    gpus: int
    tp: int
    ep: int
    pp: int
    published_mfu: float

    @property
    def devices(self) -> str:
        return f"{self.gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}xH100"

    def args(self, mbs: int = 1) -> str:
        """The run as Megatron-LM arguments: Table 3's degrees, section 4's batch, length,
        precision and capacity factor, the unpublished ones as the module docstring says."""
        v = self.values
        return (f"--tensor-model-parallel-size {self.tp} --pipeline-model-parallel-size "
                f"{self.pp} --context-parallel-size 1 --expert-model-parallel-size {self.ep} "
                f"--expert-tensor-parallel-size 1 --micro-batch-size {mbs} "
                f"--global-batch-size {GBS} --seq-length {SEQ} --num-layers "
                f"{v['num_hidden_layers']} --num-experts {experts_of(v)} --moe-router-topk "
                f"{v['num_experts_per_tok']} --bf16 --sequence-parallel "
                f"--use-distributed-optimizer --moe-grouped-gemm --moe-token-dispatcher-type "
                f"alltoall --moe-expert-capacity-factor 1.0")


def experts_of(values: dict) -> int:
    return values.get("num_local_experts") or values["num_experts"]


RUNS = {r.key: r for r in [
    Run("mixtral-8x22b", *PRESETS["mixtral-8x22b"], gpus=128, tp=2, ep=8, pp=8,
        published_mfu=0.493),
    Run("qwen2-57b-a14b", "Qwen2MoeConfig", QWEN2_57B, gpus=64, tp=2, ep=4, pp=4,
        published_mfu=0.390),
]}


def build(run: Run):
    """(model, inputs, kwargs, LLMShape, config) of the run's model on meta, batch GBS."""
    import transformers

    config = getattr(transformers, run.config)(**run.values)
    model, inputs, kwargs = build_llm(config, GBS, SEQ)
    return model, inputs, kwargs, llm_shape(model, config, run.key), config


def megatron_flops(config, batch: int = GBS, seq: int = SEQ) -> float:
    """One step's FLOPs as Megatron-LM counts them (module docstring): forward, wgrad and
    dgrad of every GEMM, attention's two matmuls over the whole s x s score matrix."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q_ratio = heads * head_dim / h
    moe_ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    attention = (1 + config.num_key_value_heads / heads + seq / h) * q_ratio
    mlp = moe_ffn / h * config.num_experts_per_tok * 1.5 + shared / h * 1.5  # SwiGLU: 3/2
    logits = config.vocab_size / (2 * layers * h)
    return 12 * batch * seq * layers * h * h * (attention + mlp + logits)


def mfu(flops: float, step_s: float, gpus: int) -> float:
    return flops / (step_s * gpus * PEAK)


def price_nearest(config, model, inputs, kwargs, devices: str, search_time_s: float):
    """(price_job's plan, the job priced, what differs): the job itself, or where hyplan
    does not run its experts' EP group on its microbatches (planner.price_job says why) the
    fewest microbatches (more rows each) that it does, said."""
    local, first = config.global_batch // config.dp, None
    for m in sorted((m for m in range(1, config.microbatches + 1) if local % m == 0),
                    reverse=True):
        job = replace(config, microbatches=m)
        try:
            plan = planner.price_job(model, devices, job, inputs, kwargs, tracer="blocks",
                                     search_time_s=search_time_s)
        except ValueError as error:
            first = first or error
            continue
        return plan, job, differs(job, config)
    raise ValueError(f"no microbatch count of {config.describe()} runs in hyplan: {first}")


def expert_degrees(plan) -> str:
    """Each experts layer's EP group (ranks) and its wrapping over the ranks sharing its
    experts, counted: "ep" 0 in a name is the tp group (planner.expert_degrees)."""
    tp = plan.mesh.size("tp")
    kinds = Counter()
    for layer in plan.layers:
        parsed = parse_name(layer.strategy)
        if parsed is not None:
            kinds[f"EP {parsed[0] or tp}" + (" +fsdp" if layer.dp_shard else "")] += 1
    return ", ".join(f"{k} x{n}" for k, n in kinds.most_common()) or "no expert parallelism"


def mfu_line(plan, config, shape, gpus: int) -> str:
    step = plan.predicted.step_time_s
    hyplan_count = shape.flops_per_token(SEQ) * GBS * SEQ
    return (f"MFU {mfu(megatron_flops(config), step, gpus):.1%} as Megatron counts "
            f"({mfu(hyplan_count, step, gpus):.1%} as 6 x active params + attention)")


# the variants priced: (label, what it stands for, compile lever, recompute mode)
VARIANTS = {
    "written": ("as written", "Hugging Face's modules kernel by kernel, no recompute",
                False, "none"),
    "fused": ("fused", "Megatron-Core's fused kernels (Transformer Engine's norms, SwiGLU, "
              "rotary, permutation) priced as hyplan's compile lever, as megatron_jobs "
              "prices Megatron-LM's", True, "none"),
    "fused-selective": ("fused, recompute where memory needs it", "the same, and the "
                        "unpublished recompute as --recompute-activations (selective), "
                        "priced as whole blocks recomputed where memory needs them",
                        True, "selective"),
}


def price(run: Run, variants: list[str], search_time_s: float, own: bool) -> None:
    """One run: imported, priced beside its published MFU in each variant (VARIANTS),
    hyplan's own plan beside it with the last variant's kernel levers."""
    model, inputs, kwargs, shape, config = build(run)
    job = read_megatron(run.args(), run.gpus)
    print(f"== {run.key}: {shape.params / 1e9:.1f} B parameters ({shape.active_params / 1e9:.1f}"
          f" B active) on {run.devices} (Table 3, MCore w/ Folding)")
    print(f"  arguments: {run.args()}")
    print(f"  imported: {job.describe()}; global batch {job.global_batch}, seq {job.seq_len}, "
          f"{job.precision}, {job.experts} experts top-{job.router_topk}")
    flops = megatron_flops(config)
    print(f"  FLOPs a step: {flops:.4e} as Megatron counts, "
          f"{shape.flops_per_token(SEQ) * GBS * SEQ:.4e} as 6 x active params + attention")
    published = flops / (run.published_mfu * run.gpus * PEAK)
    print(f"  published: MFU {run.published_mfu:.1%}: a step of {published:.2f} s, "
          f"{GBS * SEQ / published / run.gpus:,.0f} tokens/s/GPU")
    lines, plan = [], None
    for key in variants:
        label, means, compile_, recompute = VARIANTS[key]
        started = time.perf_counter()
        plan, priced, what = price_nearest(replace(job, compile=compile_, recompute=recompute),
                                           model, inputs, kwargs, run.devices, search_time_s)
        print(f"  {label}: {means}; priced in {time.perf_counter() - started:.1f} s"
              + (f"; not as written: priced with {what}" if what else ""))
        print(f"    {describe(plan, SEQ)}; {mfu_line(plan, config, shape, run.gpus)}")
        print(f"    experts: {expert_degrees(plan)}; solver {plan.solver.status}, gap "
              f"{plan.solver.gap:.2%}; {plan.solver.note}", flush=True)
        got = mfu(flops, plan.predicted.step_time_s, run.gpus)
        lines.append(f"  | {run.key} | {label} | {run.published_mfu:.1%} | {got:.1%} | "
                     f"{got / run.published_mfu - 1:+.1%} | "
                     f"{max(plan.predicted.memory_bytes) / 1e9:.1f} of "
                     f"{plan.predicted.memory_limit_bytes / 1e9:.1f} GB | "
                     f"{'yes' if fits(plan) else 'no'} |")
    print("  | run | priced | published MFU | hyplan MFU | error | memory/GPU | fits |")
    print("\n".join(lines))
    if own and plan is not None:
        own_plan(run, (model, inputs, kwargs, shape, config), plan, search_time_s)
    print(flush=True)


def own_plan(run: Run, built, priced, search_time_s: float) -> None:
    """hyplan's 3-D plan for the same model, devices and batch, with the job's kernel
    levers (its cluster's), as torchtitan_jobs and megatron_jobs put it beside the job."""
    model, inputs, kwargs, shape, config = built
    started = time.perf_counter()
    plan = planner.optimize(model, priced.cluster, inputs, kwargs, mesh="3d", tracer="blocks",
                            precision=priced.precision, search_time_s=search_time_s)
    took = time.perf_counter() - started
    dims = " x ".join(f"{n} {s}" for n, s in zip(plan.mesh.dim_names, plan.mesh.shape))
    schedule = (f", {plan.pipeline.schedule} ({plan.pipeline.chunks} per rank)"
                if plan.pipeline else "")
    beside = (f"{priced.predicted.step_time_s / plan.predicted.step_time_s:.2f}x the job's "
              f"throughput" if fits(priced) else "the job does not fit: no ratio")
    print(f"  hyplan's plan (planned in {took:.1f} s, search_time_s {search_time_s:g}): {dims}"
          f"{schedule}, {plan.microbatches} microbatch(es); {beside}")
    print(f"    {describe(plan, SEQ)}; {mfu_line(plan, config, shape, run.gpus)}")
    print(f"    experts: {expert_degrees(plan)}; solver {plan.solver.status}, gap "
          f"{plan.solver.gap:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated: "
                        + ", ".join(RUNS))
    parser.add_argument("--search-time", type=float, default=60.0,
                        help="search_time_s of each price and plan (default 60)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: "
                        + ", ".join(f"{k} ({v[1]})" for k, v in VARIANTS.items()))
    parser.add_argument("--no-own", action="store_true",
                        help="price the published runs only, without hyplan's own plan")
    args = parser.parse_args()
    for key in args.runs.split(","):
        price(RUNS[key], args.variants.split(","), args.search_time, not args.no_own)


if __name__ == "__main__":
    main()

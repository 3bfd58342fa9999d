"""Planning at scale: time per phase (trace, profile, strategies + solve) and the planning
process's peak memory, for models far larger than this machine, built on the meta device.

    PYTHONPATH=$PWD python benchmarks/scale.py            # all cases
    PYTHONPATH=$PWD python benchmarks/scale.py chain1000  # one case

Cases: a 1,000-layer synthetic chain (fx), GPT-2 XL (1.5 B, transformers, torch.export) and
a 7 B Llama-style model (transformers LlamaConfig, torch.export), each for 8xA100-80GB and
4x8xH100. Nothing is downloaded and no weight is allocated. The machine is shared with
other work: the CPU time of other processes during each run is printed beside it.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
from torch import nn

from planner.choices import layer_choices
from planner.ilp import solve
from planner.profiled import trace_model
from profiler import profile
from strategies.parse import parse_devices
from strategies.precision import at_precision


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB


def _others_cpu_s() -> float:
    """CPU seconds used by every process on the machine (from /proc/stat) minus ours."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:8]]
    total = (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")
    mine = sum(os.times()[:2])
    return total - mine


def chain(layers: int = 1000, width: int = 1024, batch: int = 64):
    with torch.device("meta"):
        blocks = []
        for _ in range(layers // 2):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*blocks)
    return model, (torch.empty(batch, width, device="meta"),), {}


def gpt2_xl(batch: int = 16, seq: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=seq,
                        tie_word_embeddings=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"use_cache": False}


def llama_7b(batch: int = 16, seq: int = 2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                         max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"use_cache": False}


CASES = {"chain1000": chain, "gpt2-xl": gpt2_xl, "llama-7b": llama_7b}
DEVICES = ("8xA100-80GB", "4x8xH100")


def run(name: str) -> None:
    start, others = time.perf_counter(), _others_cpu_s()
    model, args, kwargs = CASES[name]()
    params = sum(p.numel() for p in model.parameters())
    built = time.perf_counter()
    graph = trace_model(model, args, kwargs)
    traced = time.perf_counter()
    graph = profile(graph)
    profiled = time.perf_counter()
    print(f"{name}: {params / 1e9:.2f} B parameters ({params * 4 / 1e9:.1f} GB in fp32), "
          f"{len(graph.layers)} layers by {graph.tracer}; build {built - start:.1f} s, "
          f"trace {traced - built:.1f} s, profile {profiled - traced:.1f} s")
    for devices in DEVICES:
        t0 = time.perf_counter()
        cluster = parse_devices(devices)  # its default precision: bf16-mixed on A100/H100
        choices = layer_choices(at_precision(graph, cluster.training_precision), cluster,
                                "adam", cluster.device.memory_bytes)
        t1 = time.perf_counter()
        solution = solve(choices.problem, 60.0)
        t2 = time.perf_counter()
        used = {}
        for i, row in enumerate(choices.layers):
            s = row.strategies[solution.choice[i]].name
            used[s] = used.get(s, 0) + 1
        print(f"  {devices}: strategies+costs {t1 - t0:.1f} s, solve {t2 - t1:.2f} s "
              f"({solution.status}, objective {solution.objective_s * 1e3:.2f} ms, bound "
              f"{solution.bound_s * 1e3:.2f} ms, {solution.num_variables} variables); "
              f"strategies used {dict(sorted(used.items()))}")
    total = time.perf_counter() - start
    print(f"  end to end {total:.1f} s; peak memory of this process {_peak_gb():.2f} GB; "
          f"other processes used {_others_cpu_s() - others:.1f} CPU s meanwhile "
          f"(of {2 * total:.0f} on 2 cores)")


if __name__ == "__main__":
    for case in sys.argv[1:] or list(CASES):
        run(case)

"""What one lent GPU shows of hyplan's predictions (issue 14, point 5): run it on the device
machine, keep its output in benchmarks/results/ under the device's name.

    PYTHONPATH=$PWD python benchmarks/gpu_lent.py [--out DIR] [--small]

Four parts, each printed as it ends (a part that fails prints its traceback and the rest
still run):

1. **First-use calibration**: `parse_devices(1)` in a fresh cache, as a user's first plan
   for this GPU does (strategies.profile_cache: the quick calibration, CUDA events), then
   again from the cache; the rates it measured beside the catalog's datasheet figures.
2. **Kernels against the GPU model by shape** (strategies.gpu_compute): GEMMs over sizes in
   bf16 and fp32, a large copy and a tiny kernel (the launch floor), each measured with
   CUDA events beside what `gemm_s` / `memory_bound_s` price for the catalog device.
3. **Single layers**: a Linear (large, and small), scaled-dot-product attention, a norm,
   an activation, an embedding, a convolution, each planned by `planner.optimize` on one
   device (the catalog GPU by shape, and this GPU's calibrated profile) in bf16-mixed, its
   predicted forward + backward beside the measured one (autocast, CUDA events, the input
   needing its gradient as a middle layer's does).
4. **A planned 1-GPU bf16 training step of Hugging Face models** (transformers configs,
   random weights): `planner.optimize` -> `executor.parallelize` -> `executor.train_step`
   with AdamW on a one-rank NCCL group, median of the timed steps, beside the same step
   written by hand (autocast, no hyplan) and beside both predictions, term by term.

`--small` runs every part at toy sizes (on a CPU too), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

RESULTS: dict = {}
LINES: list[str] = []
OUT: Path | None = None


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)
    if OUT is not None:
        (OUT / "gpu_lent.txt").write_text("\n".join(LINES) + "\n")
        (OUT / "gpu_lent.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def part(title: str):
    def wrap(fn):
        def run(*args, **kwargs):
            say(f"\n## {title}")
            began = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception:  # one part's failure must not lose the others' figures
                say("FAILED:\n" + traceback.format_exc())
            say(f"({time.perf_counter() - began:.1f} s)")
        return run
    return wrap


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def seconds_per_call(fn, min_s: float = 0.05, warmup: int = 3) -> float:
    """Mean seconds of fn() over enough back-to-back calls to fill `min_s` (CUDA events on
    a GPU, so the launches queue as in training and the time is the GPU's)."""
    for _ in range(warmup):
        fn()
    dev = device()
    if dev.type != "cuda":
        began, calls = time.perf_counter(), 0
        while time.perf_counter() - began < min_s or calls < 3:
            fn()
            calls += 1
        return (time.perf_counter() - began) / calls
    calls = 1
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
        if elapsed >= min_s or calls >= 4096:
            return elapsed / calls
        calls = min(4096, max(calls * 2, int(calls * min_s / max(elapsed, 1e-6)) + 1))


def catalog_name() -> str:
    """The catalog entry of this GPU (strategies.devices), by its reported name."""
    if device().type != "cuda":
        return "H100"
    name = torch.cuda.get_device_name(0)
    for key in ("H200", "H100", "A100"):
        if key in name:
            return {"A100": "A100-80GB"}.get(key, key)
    return "H100"


# --- part 1 -------------------------------------------------------------------------------

@part("1. First-use calibration (fresh cache) and the cached profile")
def first_use() -> None:
    from strategies.devices import DEVICES
    from strategies.parse import parse_devices

    os.environ["HYPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyplan-gpu-cache-")
    began = time.perf_counter()
    cluster = parse_devices(1)
    first = time.perf_counter() - began
    began = time.perf_counter()
    parse_devices(1)
    cached = time.perf_counter() - began
    spec, cat = cluster.device, DEVICES[catalog_name()]
    say(f"first use {first:.1f} s, cached {cached * 1e3:.1f} ms; profile device {spec.name!r} "
        f"({spec.kind}), source: {spec.source}")
    rows = [("fp32 matmul TFLOP/s", spec.peak_flops.get("float32"), cat.peak_flops.get("float32")),
            ("bf16 matmul TFLOP/s", spec.peak_flops.get("bfloat16"),
             cat.peak_flops.get("bfloat16")),
            ("copy GB/s (read+write)", spec.memory_bandwidth_bytes_per_s,
             cat.memory_bandwidth_bytes_per_s)]
    for label, measured, datasheet in rows:
        scale = 1e12 if "FLOP" in label else 1e9
        say(f"  {label:24s} measured {(measured or 0) / scale:8.1f}   catalog "
            f"{cat.name} datasheet {(datasheet or 0) / scale:8.1f}")
    RESULTS["calibration"] = {"first_use_s": first, "cached_s": cached,
                              "fp32_flops": spec.peak_flops.get("float32"),
                              "bf16_flops": spec.peak_flops.get("bfloat16"),
                              "copy_bytes_per_s": spec.memory_bandwidth_bytes_per_s}


# --- part 2 -------------------------------------------------------------------------------

@part("2. Kernels against the GPU model by shape (strategies.gpu_compute)")
def kernels(small: bool) -> None:
    from strategies import gpu_compute
    from strategies.devices import DEVICES

    spec = DEVICES[catalog_name()]
    dev = device()
    sizes = ([(256, 256, 256), (512, 512, 512)] if small else
             [(256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
              (8192, 8192, 8192), (8192, 4096, 4096), (8192, 11008, 4096), (8192, 4096, 11008),
              (4096, 4096, 8192), (2048, 128256, 4096), (8192, 1024, 1024), (512, 4096, 4096),
              (16384, 5120, 5120), (8192, 14336, 4096), (1000, 1000, 1000), (4000, 4000, 4000)])
    rows = []
    say(f"catalog {spec.name}: peak bf16 {spec.peak_flops['bfloat16'] / 1e12:.0f} TFLOP/s, "
        f"matmul_fraction {spec.shape.matmul_fraction:.3f}, tiles "
        f"{spec.shape.tile_m}x{spec.shape.tile_n}, {spec.shape.sm_count} SMs")
    say(f"{'dtype':9s} {'M x N x K':>22s} {'measured us':>12s} {'predicted us':>13s} "
        f"{'pred/meas':>9s} {'TFLOP/s':>8s}")
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for m, n, k in sizes:
            a = torch.randn(m, k, device=dev, dtype=dtype)
            b = torch.randn(k, n, device=dev, dtype=dtype)
            t = seconds_per_call(lambda: torch.mm(a, b))
            p = gpu_compute.gemm_s(m, n, k, spec, name)
            rate = 2 * m * n * k / t / 1e12
            say(f"{name:9s} {f'{m} x {n} x {k}':>22s} {t * 1e6:12.1f} {p * 1e6:13.1f} "
                f"{p / t:9.2f} {rate:8.1f}")
            rows.append({"dtype": name, "m": m, "n": n, "k": k, "measured_s": t,
                         "predicted_s": p})
            del a, b
    numel = 2**20 if small else 2**28  # 1 GiB of fp32
    src = torch.ones(numel, device=dev)
    dst = torch.empty_like(src)
    t = seconds_per_call(lambda: dst.copy_(src))
    moved = 2 * numel * 4
    p = gpu_compute.memory_bound_s(moved, 1, spec)
    say(f"copy {moved / 1e9:.2f} GB moved: measured {t * 1e6:.1f} us ({moved / t / 1e9:.0f} "
        f"GB/s), predicted {p * 1e6:.1f} us (pred/meas {p / t:.2f})")
    rows = 256 if small else 8192
    x = torch.randn(rows, 4096, device=dev)
    xb, w = x.to(torch.bfloat16), torch.randn(4096, device=dev)
    say("eager elementwise kernels (forward only) against memory_bound_s(elementwise=True):")
    elementwise = []
    for label, fn, moved in (
            ("add fp32, same shapes", lambda: x + x, 3 * x.nbytes),
            ("mul bf16 x fp32 -> fp32", lambda: xb * x, xb.nbytes + 2 * x.nbytes),
            ("cast fp32 -> bf16", lambda: x.to(torch.bfloat16), x.nbytes + xb.nbytes),
            ("mean over the last dim, fp32", lambda: x.mean(-1), x.nbytes),
            ("mul by a row vector, fp32", lambda: x * w, 2 * x.nbytes),
            ("silu bf16", lambda: F.silu(xb), 2 * xb.nbytes),
            ("pow 2 fp32", lambda: x.pow(2), 2 * x.nbytes)):
        t_op = seconds_per_call(fn)
        p_op = gpu_compute.memory_bound_s(moved, 1, spec, elementwise=True)
        say(f"  {label:30s} {moved / 1e6:7.1f} MB: measured {t_op * 1e6:8.1f} us "
            f"({moved / t_op / 1e9:5.0f} GB/s), predicted {p_op * 1e6:8.1f} us "
            f"(pred/meas {p_op / t_op:.2f})")
        elementwise.append({"op": label, "bytes": moved, "measured_s": t_op, "predicted_s": p_op})
    del x, xb, w
    tiny = torch.ones(1, device=dev)
    t_tiny = seconds_per_call(lambda: tiny.add_(1))
    say(f"launch floor (1-element add, back to back): measured {t_tiny * 1e6:.2f} us, "
        f"priced {spec.shape.launch_s * 1e6:.2f} us")
    RESULTS["kernels"] = {"gemms": rows, "elementwise": elementwise,
                          "copy": {"bytes": moved, "measured_s": t, "predicted_s": p},
                          "launch": {"measured_s": t_tiny, "priced_s": spec.shape.launch_s}}


# --- part 3 -------------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal scaled-dot-product attention over (batch, seq, heads * head_dim) q = k = v."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, x):
        b, s, h = x.shape
        q = x.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, h)


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def layer_cases(small: bool) -> list[tuple[str, nn.Module, torch.Tensor, bool]]:
    """(label, module, input, input needs grad)."""
    dev = device()
    s = 64 if small else 1
    tokens, width, ffn = 8192 // s, 4096 // s, 11008 // s
    seq, heads = 2048 // s, 32 // min(s, 8)
    return [
        (f"Linear {width}->{ffn}, {tokens} rows", nn.Linear(width, ffn, bias=False), 
         torch.randn(tokens, width), True),
        (f"Linear {width}->{width}, {tokens} rows", nn.Linear(width, width, bias=False),
         torch.randn(tokens, width), True),
        (f"Linear 1024->1024, 512 rows", nn.Linear(1024 // s, 1024 // s),
         torch.randn(512 // s, 1024 // s), True),
        (f"SDPA causal, 4 x {seq} x {heads} heads x 128", Attention(heads),
         torch.randn(4, seq, heads * (128 // s)), True),
        (f"LayerNorm {width}, {tokens} rows", nn.LayerNorm(width), torch.randn(tokens, width),
         True),
        (f"RMSNorm {width}, {tokens} rows", RMSNorm(width), torch.randn(tokens, width), True),
        (f"GELU {tokens} x {ffn}", nn.GELU(), torch.randn(tokens, ffn), True),
        (f"Embedding 32000 x {width}, 4 x {seq} ids", nn.Embedding(32000 // s, width),
         torch.randint(0, 32000 // s, (4, seq)), False),
        (f"Conv2d 3x3 256->256, 32 x 56 x 56", nn.Conv2d(256 // s, 256 // s, 3, padding=1),
         torch.randn(32 // min(s, 8), 256 // s, 56 // min(s, 8), 56 // min(s, 8)), True),
    ]


def measured_fwd_bwd(module: nn.Module, x: torch.Tensor, needs_grad: bool) -> float:
    dev = device()
    x = x.to(dev).requires_grad_(needs_grad) if x.is_floating_point() else x.to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        grad = torch.ones_like(module(x))

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = module(x)
        y.backward(grad)

    return seconds_per_call(step, min_s=0.1)


def predicted(module, x, devices) -> tuple[float, dict]:
    import planner

    plan = planner.optimize(module, devices, (x,), precision="bf16-mixed", optimizer="adamw",
                            measure=False, mesh="1d")
    by_kind: dict[str, float] = {}
    for layer in plan.layers:
        by_kind[layer.kind] = by_kind.get(layer.kind, 0.0) + layer.compute_s
    return sum(layer.compute_s for layer in plan.layers), by_kind


@part("3. Single layers, bf16-mixed forward + backward: planned vs measured")
def layers(small: bool) -> None:
    dev = device()
    catalog = f"1x{catalog_name()}"
    local = 1 if dev.type == "cuda" else "1xcpu"
    say(f"{'layer':44s} {'measured us':>12s} {catalog + ' us':>14s} {'x':>6s} "
        f"{'calibrated us':>14s} {'x':>6s}")
    rows = []
    for label, module, x, needs_grad in layer_cases(small):
        module = module.to(dev)
        t = measured_fwd_bwd(module, x, needs_grad)
        p_cat, kinds = predicted(module, x.to(dev), catalog)
        p_loc, _ = predicted(module, x.to(dev), local)
        say(f"{label:44s} {t * 1e6:12.1f} {p_cat * 1e6:14.1f} {p_cat / t:6.2f} "
            f"{p_loc * 1e6:14.1f} {p_loc / t:6.2f}   ({', '.join(sorted(kinds))})")
        rows.append({"layer": label, "measured_s": t, "catalog_s": p_cat, "calibrated_s": p_loc,
                     "kinds": kinds})
    RESULTS["layers"] = rows


# --- part 4 -------------------------------------------------------------------------------

def hf_models(small: bool):
    """(label, build() -> (model, ids, loss_fn)): a Llama of 953 M parameters and GPT-2
    small, random weights from transformers configs, on this device."""
    from examples.hf_llama import NextTokenLoss

    dev = device()

    def llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                    max_position_embeddings=64) if small else
               dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                    max_position_embeddings=2048))
        batch, seq = (2, 64) if small else (4, 2048)
        with torch.device(dev):
            model = LlamaForCausalLM(LlamaConfig(**cfg, use_cache=False, attention_dropout=0.0))
        return model, torch.randint(0, cfg["vocab_size"], (batch, seq), device=dev)

    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = (dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256) if small
               else dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024))
        batch, seq = (2, 64) if small else (16, 1024)
        with torch.device(dev):
            model = GPT2LMHeadModel(GPT2Config(**cfg, use_cache=False, attn_pdrop=0.0,
                                               embd_pdrop=0.0, resid_pdrop=0.0))
        return model, torch.randint(0, cfg.get("vocab_size", 50257), (batch, seq), device=dev)

    label_llama = ("Llama 2-layer toy" if small
                   else "Llama 953 M (16 x 2048, vocab 32000), batch 4 x 2048")
    label_gpt2 = "GPT-2 toy" if small else "GPT-2 small (124 M), batch 16 x 1024"
    return [(label_llama, llama), (label_gpt2, gpt2)], NextTokenLoss()


def timed_steps(step, steps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        step()
    cuda = device().type == "cuda"
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return times


def terms(plan) -> str:
    p = plan.predicted
    return (f"{p.step_time_s * 1e3:.1f} ms (compute {p.compute_s * 1e3:.1f}, communication "
            f"{p.communication_s * 1e3:.1f}, optimizer {p.other_s * 1e3:.1f}, fixed "
            f"{p.fixed_s * 1e3:.1f}; memory {max(p.memory_bytes) / 2**30:.1f} GiB)")


GEMM_KINDS = {"linear", "mm", "addmm", "bmm", "matmul", "conv1d", "conv2d", "baddbmm"}


def kind_term(kind: str) -> str:
    """The term a planned layer's compute belongs to: GEMM, attention or memory-bound."""
    k = kind.lower()
    if k in GEMM_KINDS:
        return "GEMM"
    if "attention" in k:
        return "attention"
    return "memory-bound"


def kernel_term(name: str) -> str:
    """The term a CUDA kernel belongs to, by its name."""
    n = name.lower()
    if "nccl" in n:
        return "collectives"
    if any(t in n for t in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(t in n for t in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "sm90_")):
        return "GEMM"
    if any(t in n for t in ("multi_tensor", "foreach", "adam")):
        return "optimizer"
    return "memory-bound"


def kernel_terms(step, steps: int = 2) -> tuple[dict, list, float]:
    """({term: GPU seconds per step}, [(kernel, seconds per step)] largest first, wall
    seconds per step) of `steps` profiled steps (torch.profiler, CUDA kernels only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / steps
    terms_s: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if not us:
            continue
        seconds = us / 1e6 / steps
        term = kernel_term(event.key)
        terms_s[term] = terms_s.get(term, 0.0) + seconds
        kernels.append((event.key[:90], seconds, event.count // steps, term))
    kernels.sort(key=lambda k: -k[1])
    return terms_s, kernels, wall


def op_times(step, steps: int = 2) -> list[tuple[str, float, int]]:
    """[(ATen op, GPU seconds per step of the kernels it launched itself, calls per step)],
    largest first: which ops the memory-bound time goes to."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        us = getattr(event, "self_device_time_total", 0.0)
        if us:
            rows.append((event.key, us / 1e6 / steps, event.count // steps))
    return sorted(rows, key=lambda r: -r[1])


def predicted_ops(model, ids) -> list[tuple[str, float, float, int]]:
    """[(ATen op, forward bytes, backward bytes, kernels)] the traffic model counts for the
    model's bf16-mixed step, by op, largest first."""
    from profiler.export_trace import export
    from profiler.traffic import op_name, traffic

    program = export(model, (ids,), {"use_cache": False})
    names = {n.name: op_name(n) for n in program.graph_module.graph.nodes
             if n.op == "call_function"}
    by: dict[str, list] = {}
    for node, t in traffic(program, "bfloat16", ids.shape[0]).items():
        name = names.get(node, "(a parameter, its gradients summed)")
        row = by.setdefault(name, [0.0, 0.0, 0])
        row[0] += t.forward_rows + t.forward_fixed
        row[1] += t.backward_rows + t.backward_fixed
        row[2] += t.forward_kernels + t.backward_kernels
    return sorted(((k, *v) for k, v in by.items()), key=lambda r: -(r[1] + r[2]))


def planned_terms(plan) -> dict[str, float]:
    out: dict[str, float] = {"optimizer": plan.predicted.other_s,
                             "collectives": plan.predicted.communication_s}
    for layer in plan.layers:
        term = kind_term(layer.kind)
        out[term] = out.get(term, 0.0) + layer.compute_s
    return out


@part("4. A planned 1-GPU bf16-mixed training step of Hugging Face models")
def training_steps(small: bool) -> None:
    import executor
    import planner

    dev = device()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0,
                                world_size=1)
    builds, loss_fn = hf_models(small)
    steps = 5 if small else 10
    rows = []
    for label, build in builds:
        say(f"\n{label}")
        # the step as written by hand: autocast bf16, fp32 weights, fused AdamW
        model, ids = build()
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def plain():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = model(ids, use_cache=False)
            loss = loss_fn(out, ids)
            opt.zero_grad()
            loss.backward()
            opt.step()

        hand = statistics.median(timed_steps(plain, steps))
        peak_hand = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
        say(f"  {params / 1e6:.0f} M parameters; by hand (autocast + AdamW): "
            f"{hand * 1e3:.1f} ms/step, peak memory {peak_hand / 2**30:.1f} GiB")
        del opt
        plans = {}
        for devices in (f"1x{catalog_name()}", 1 if dev.type == "cuda" else "1xcpu"):
            began = time.perf_counter()
            plan = planner.optimize(model, devices, (ids,), {"use_cache": False},
                                    precision="bf16-mixed", optimizer="adamw",
                                    measure=False if dev.type == "cuda" else None)
            plans[str(devices)] = plan
            say(f"  planned for {devices!s:8s} in {time.perf_counter() - began:5.1f} s: "
                f"predicted {terms(plan)}")
        counted = predicted_ops(model, ids)  # before parallelize wraps the model
        # the catalog plan on a GPU (one device: the plans differ in their prices only)
        plan = plans[f"1x{catalog_name()}" if dev.type == "cuda" else "1xcpu"]
        parallel = executor.parallelize(model, plan)
        opt = torch.optim.AdamW(parallel.parameters(), lr=1e-4)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def planned():
            executor.train_step(parallel, plan, (ids, ids), loss_fn, opt,
                                forward_kwargs={"use_cache": False})

        times = timed_steps(planned, steps)
        run = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
        tokens = ids.numel()
        say(f"  hyplan's plan run (parallelize + train_step): {run * 1e3:.1f} ms/step "
            f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}), "
            f"{tokens / run:,.0f} tokens/s, 6N FLOPs {6 * params * tokens / run / 1e12:.0f} "
            f"TFLOP/s, peak memory {peak / 2**30:.1f} GiB")
        for key, p in plans.items():
            err = p.predicted.step_time_s / run - 1
            say(f"  predicted for {key:8s}: {p.predicted.step_time_s * 1e3:8.1f} ms, "
                f"error {err:+.1%} vs the plan's run; memory predicted "
                f"{max(p.predicted.memory_bytes) / 2**30:.1f} GiB, measured {peak / 2**30:.1f}")
        row = {"model": label, "params": params, "by_hand_s": hand, "planned_run_s": run,
               "times": times, "peak_bytes": peak,
               "predicted": {k: p.predicted.model_dump() for k, p in plans.items()}}
        if dev.type == "cuda":
            measured_terms, kernels, wall = kernel_terms(planned)
            busy = sum(measured_terms.values())
            say(f"  term by term, per step (torch.profiler's kernel times; GPU busy "
                f"{busy * 1e3:.1f} of {wall * 1e3:.1f} ms profiled):")
            say(f"    {'term':14s} {'measured ms':>12s} " + " ".join(
                f"{'pred ' + k + ' ms':>16s}" for k in plans))
            predicted_terms = {k: planned_terms(p) for k, p in plans.items()}
            for term in ("GEMM", "attention", "memory-bound", "optimizer", "collectives"):
                say(f"    {term:14s} {measured_terms.get(term, 0.0) * 1e3:12.1f} " + " ".join(
                    f"{predicted_terms[k].get(term, 0.0) * 1e3:16.1f}" for k in plans))
            say("  largest kernels (ms per step, launches per step):")
            for name, seconds, count, term in kernels[:14]:
                say(f"    {seconds * 1e3:8.2f} {count:5d}  [{term}] {name}")
            by_kind: dict[str, list] = {}
            for layer in plan.layers:
                entry = by_kind.setdefault(layer.kind, [0, 0.0])
                entry[0] += 1
                entry[1] += layer.compute_s
            say("  planned compute by layer kind (ms per step, layers):")
            for kind, (count, seconds) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:14]:
                say(f"    {seconds * 1e3:8.2f} {count:5d}  [{kind_term(kind)}] {kind}")
            ops = op_times(planned)
            say("  ATen ops by the GPU time of the kernels each launched (ms per step, calls):")
            for name, seconds, count in ops[:30]:
                say(f"    {seconds * 1e3:8.2f} {count:5d}  {name}")
            say("  the traffic model's count, bf16-mixed, by op (GB forward, backward, kernels):")
            for name, fwd, bwd, launches in counted[:16]:
                say(f"    {fwd / 1e9:7.2f} {bwd / 1e9:7.2f} {launches:5d}  {name}")
            row.update(ops=ops[:60], counted_ops=counted)
            row.update(measured_terms=measured_terms, predicted_terms=predicted_terms,
                       kernels=kernels[:40], wall_profiled_s=wall)
            if OUT is not None:
                slug = "llama" if "Llama" in label else "gpt2"
                (OUT / f"plan-{slug}.json").write_text(plan.to_json())
        rows.append(row)
        del model, parallel, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    RESULTS["training"] = rows


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_lent.txt and .json")
    parser.add_argument("--small", action="store_true", help="toy sizes (checks the script)")
    parser.add_argument("--parts", default="1234")
    args = parser.parse_args()
    if args.out:
        OUT = Path(args.out)
        OUT.mkdir(parents=True, exist_ok=True)
    dev = device()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        say(f"# {torch.cuda.get_device_name(0)}: {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB, "
            f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}; catalog entry "
            f"{catalog_name()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    else:
        say(f"# no GPU: {dev}, torch {torch.__version__} (toy check of the script)")
    RESULTS["device"] = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    if "1" in args.parts:
        first_use()
    if "2" in args.parts:
        kernels(args.small)
    if "3" in args.parts:
        layers(args.small)
    if "4" in args.parts:
        training_steps(args.small)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

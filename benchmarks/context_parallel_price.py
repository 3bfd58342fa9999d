"""What context parallelism costs one Llama 3 8B block on 8xH100 at 32K-256K tokens, as
strategies.context prices it: the K/V all-gather and its backward reduce-scatter (time and
bytes each rank sends) and the memory a rank holds, for cp 1, 2, 4 and 8. One sequence per
microbatch (torchtitan's long-context runs). Compute is left out: it is the block's own
time / cp, and this hand-made block carries no GEMM shapes for the GPU price.

    python benchmarks/context_parallel_price.py
"""

from torch import nn

from profiler.graph import Layer, TensorMeta
from strategies.catalog import CostContext
from strategies.context import context_parallel_cost
from strategies.parse import parse_devices

HIDDEN, HEADS, KV_HEADS = 4096, 32, 8  # Llama 3 8B
BLOCK_PARAMS = 218_112_000  # one decoder block's weights (attention 41.9 M + MLP 176.2 M)
# bytes a block keeps for backward over its output's: 34·s·b·h bytes in 16-bit with the
# attention scores not kept (flash attention; Korthikanti et al. 2022), over 2·s·b·h
SAVED_PER_OUTPUT = 17


def block(seq: int) -> Layer:
    out = seq * HIDDEN * 2  # bfloat16
    return Layer(name="block", node="block", op="call_module", kind="LlamaDecoderLayer",
                 inputs=(), output=TensorMeta((1, seq, HIDDEN), "bfloat16", out),
                 module_type=nn.Module,
                 attrs={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS},
                 param_bytes=BLOCK_PARAMS * 2, param_count=BLOCK_PARAMS,
                 saved_per_output=SAVED_PER_OUTPUT)


def main() -> None:
    cluster = parse_devices("8xH100")
    ctx = CostContext(cluster=cluster, ranks=1, batch=1)
    print(f"{'seq':>7} {'cp':>3} {'K/V MiB':>8} {'gather+scatter ms':>18} "
          f"{'sent MiB/rank':>14} {'memory GiB/rank':>16}")
    for seq in (32768, 65536, 131072, 262144):
        for cp in (1, 2, 4, 8):
            cost = context_parallel_cost(block(seq), cp, ctx)
            print(f"{seq:>7} {cp:>3} {cost.notes['kv_bytes'] / 2**20:>8.0f} "
                  f"{cost.communication_s * 1e3:>18.3f} "
                  f"{cost.notes['kv_sent_bytes'] / 2**20:>14.1f} "
                  f"{cost.memory_bytes / 2**30:>16.2f}")


if __name__ == "__main__":
    main()

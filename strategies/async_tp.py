"""Asynchronous tensor parallelism priced: which TP all-gathers and reduce-scatters torch's
micro-pipelining fuses with a matmul, and what of each stays in the step.

Sequence-parallel TP all-gathers a block's input before its column-parallel matmuls and
reduce-scatters the row-parallel matmul's output. torch's async TP (the Inductor pass
`torch._inductor.fx_passes.micro_pipeline_tp`, turned on by torchtitan's
`enable_async_tensor_parallel` with compile and symmetric memory on the TP group) rewrites
two patterns only, and each into a pipeline of tp steps of point-to-point copies made by
the copy engine beside matmuls on 1/tp of the rows (torch.distributed._symmetric_memory,
`_pipelined_multi_all_gather_and_consume` and `_pipelined_produce_and_all2all`, read at
torch's main branch, 2025):

- all_gather(A) -> mm(A, B) (one or several B: q, k, v; w1, w3): the local shard's matmul
  runs while the first remote shard is copied, then each copied shard's matmul; copies
  from different streams do not overlap one another. What stays: the copy of the local
  shard into the symmetric buffer and a barrier, deliberately not overlapped (the code's
  comment: overlapping them scheduled badly), and whatever the copies take beyond the
  matmuls of the tp - 1 remote shards;
- reduce_scatter(mm(A, B)) with the mm the reduce-scatter's only producer: each remote
  rank's chunk is computed and pulled while the next is computed, the local chunk last,
  then the tp partial chunks are summed by a kernel of its own (read the n bytes of
  partials, write n / tp): that sum stays, with what the copies take beyond the matmuls.
  `_find_producer_matmul` matches an mm (or reshape-mm-reshape) only: a reduce-scatter of
  a sum of matmuls is not fused. So the backward reduce-scatter of a column-parallel
  group's input gradient (q, k and v's, or w1 and w3's, input gradients summed by
  autograd) stays as blocking as before.

So a fused collective leaves `exposed_s(collective_s, matmul_s, tp, copy_s)`: the copies
past the matmul's (tp - 1) / tp remote part, plus the memory pass `copy_s` of the local
copy or the partials' sum. The decomposed matmuls alternate between two streams, which
the code says "greatly reduc[es] quantization inefficiency": priced at the whole
matmul's time.

Checked, never fitted, against torchtitan's own table
(benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: Llama 3 70B on 256 H100, FSDP 32 x
TP 8, compiled: bf16 597.3 -> 652.4 tokens/s/GPU with async TP, float8 tensorwise 809.8 ->
942.4, float8 rowwise 599.6 -> 624.8; 8B on 64 H100, FSDP 8 x TP 8: bf16 4378 -> 4809,
tensorwise 5078 -> 5570) by benchmarks/titan_levers.py titan70 titan8tp (results in
benchmarks/results/titan-levers-2cpu.txt): the plans priced 70B 580 -> 618 (+6.6% against
the published +9.2%), 673 -> 701 (+4.2% against +16.4%), 586 -> 619 (+5.6% against +4.2%);
8B 4633 -> 5058 (+9.2% against +9.9%), 5155 -> 5378 (+4.3% against +9.7%).
The rule before this one (every chunk but the first hidden, applied after planning to all
of the TP layers' communication, their FSDP gathers included) priced the bf16 row +19.9%
over the published figure.
"""

from __future__ import annotations

# the collectives torch's micro-pipeline pass fuses with the matmul beside them
FUSED = ("all_gather", "reduce_scatter")


def exposed_s(collective_s: float, matmul_s: float, tp: int, copy_s: float = 0.0) -> float:
    """What a fused TP all-gather or reduce-scatter (`collective_s`, as priced blocking)
    leaves in the step beside its matmul of `matmul_s` over `tp` ranks: the copies past
    the matmul of the tp - 1 remote shards, and `copy_s`, the memory pass the fused op
    adds outside the pipeline (`copy_bytes`)."""
    if tp <= 1 or collective_s <= 0:
        return collective_s
    return max(0.0, collective_s - matmul_s * (tp - 1) / tp) + copy_s


def copy_bytes(collective: str, nbytes: float, tp: int) -> float:
    """Bytes of the fused op's memory pass outside its pipeline, for a collective over a
    tensor of `nbytes` (its whole size): an all-gather copies the local shard into the
    symmetric buffer (read and write nbytes / tp); a reduce-scatter sums the tp partial
    chunks (read nbytes, write nbytes / tp)."""
    if collective == "all_gather":
        return 2 * nbytes / tp
    return nbytes + nbytes / tp

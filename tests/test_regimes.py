"""Regimes: a collective's cost fitted piecewise where its bandwidth changes with size, and
compute priced by how many processes share the cores at once (hand-computed figures)."""

import pytest

from profiler.calibrate import Sample
from strategies.calibrated import ClusterProfile, fit_collective, fit_link
from strategies.collectives import COEFFICIENTS, collective_time_s
from strategies.cluster import Cluster, memory_sharing_slowdown, time_sharing_slowdown
from strategies.devices import CollectiveFit, DeviceSpec, LinkSpec, Regime

MB = 2**20
SIZES = [1 << 10, 64 << 10, 1 * MB, 8 * MB, 32 * MB, 64 * MB, 128 * MB]
CACHE = 32 * MB


def _two_regimes(collective, inside, past, split=CACHE, ranks=(2,)):
    """Exact timings: (alpha, beta) `inside` up to `split` bytes, `past` beyond it."""
    out = []
    for p in ranks:
        a, b = COEFFICIENTS[collective](p)
        for n in SIZES:
            alpha, beta = inside if n <= split else past
            out.append(Sample(collective=collective, ranks=p, nbytes=n,
                              seconds=a * alpha + b * n / beta))
    return out


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "bucket_all_reduce"])
def test_piecewise_fit_recovers_both_regimes_exactly_at_the_cache(collective):
    # gloo past the shared cache: half the bandwidth, a little more latency
    samples = _two_regimes(collective, (0.5e-3, 1.2e9), (0.8e-3, 0.6e9), ranks=(2, 4))
    fit = fit_collective(samples, split_bytes=CACHE)
    assert (fit.latency_s, fit.bandwidth_bytes_per_s) == pytest.approx((0.5e-3, 1.2e9), rel=1e-9)
    (past,) = fit.regimes
    assert past.above_bytes == CACHE
    assert (past.latency_s, past.bandwidth_bytes_per_s) == pytest.approx((0.8e-3, 0.6e9),
                                                                         rel=1e-9)


def test_searched_split_finds_the_change_where_the_machine_does_not_say():
    # a protocol change between 1 MB and 8 MB: the split lands on the last size below it
    samples = _two_regimes("all_reduce", (10e-6, 50e9), (40e-6, 200e9), split=1 * MB)
    fit = fit_collective(samples)
    assert fit.latency_s == pytest.approx(10e-6, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(50e9, rel=1e-9)
    assert fit.regimes[0].above_bytes == 1 * MB
    assert fit.regimes[0].bandwidth_bytes_per_s == pytest.approx(200e9, rel=1e-9)


def test_past_the_cache_time_may_grow_faster_than_in_proportion():
    # FSDP2 layers here: 38 MB in 65 ms, 67 MB in 280 ms. The range's own line runs
    # through both (its intercept below zero, its time positive from the split on), where
    # one forced through a non-negative intercept was 50% short at 67 MB
    a, b = COEFFICIENTS["fsdp_layer"](2)
    small = [Sample(collective="fsdp_layer", ranks=2, nbytes=n, seconds=a * 1e-3 + b * n / 1e9)
             for n in (64 << 10, 1 * MB, 4 * MB, 16 * MB)]
    big = [Sample(collective="fsdp_layer", ranks=2, nbytes=38 * MB, seconds=0.065),
           Sample(collective="fsdp_layer", ranks=2, nbytes=67 * MB, seconds=0.280)]
    link = LinkSpec(name="l", bandwidth_bytes_per_s=1e9, latency_s=1e-3,
                    collectives={"fsdp_layer": fit_collective(small + big, split_bytes=CACHE)})
    (past,) = link.collectives["fsdp_layer"].regimes
    assert past.latency_s < 0
    for s in big:
        assert collective_time_s("fsdp_layer", s.nbytes, 2, link) == pytest.approx(s.seconds)
    assert collective_time_s("fsdp_layer", CACHE + 1, 2, link) > 0
    # where the line would cross zero inside the range, the clamped line stays
    flat = [Sample(collective="fsdp_layer", ranks=2, nbytes=n, seconds=t)
            for n, t in ((33 * MB, 0.001), (67 * MB, 0.280))]
    (clamped,) = fit_collective(small + flat, split_bytes=CACHE).regimes
    assert clamped.latency_s >= 0


def test_one_line_stays_one_line():
    samples = _two_regimes("all_gather", (0.5e-3, 1e9), (0.5e-3, 1e9))
    assert fit_collective(samples).regimes == ()
    assert fit_collective(samples, split_bytes=CACHE).regimes[0].bandwidth_bytes_per_s == \
        pytest.approx(1e9, rel=1e-9)
    # too few sizes past the split for a line of their own: one line
    few = [s for s in samples if s.nbytes <= 64 * MB]
    assert fit_collective(few, split_bytes=CACHE).regimes == ()


def test_a_message_past_the_cache_is_priced_by_its_regime():
    fit = CollectiveFit(latency_s=0.5e-3, bandwidth_bytes_per_s=1.2e9, regimes=(
        Regime(above_bytes=CACHE, latency_s=0.8e-3, bandwidth_bytes_per_s=0.6e9),))
    link = LinkSpec(name="gloo", bandwidth_bytes_per_s=1.2e9, latency_s=0.5e-3,
                    collectives={"all_gather": fit})
    # 2 ranks: all_gather = 1·alpha + 1/2·n/beta
    assert collective_time_s("all_gather", 16 * MB, 2, link) == pytest.approx(
        0.5e-3 + 8 * MB / 1.2e9)
    assert collective_time_s("all_gather", 128 * MB, 2, link) == pytest.approx(
        0.8e-3 + 64 * MB / 0.6e9)
    samples = _two_regimes("all_gather", (0.5e-3, 1.2e9), (0.8e-3, 0.6e9))
    fitted = fit_link(samples, "gloo", "test", split_bytes=CACHE)
    assert collective_time_s("all_gather", 128 * MB, 2, fitted) == pytest.approx(
        0.8e-3 + 64 * MB / 0.6e9)


# --- time-sharing -----------------------------------------------------------------------

def test_time_sharing_by_hand():
    # 4 processes of 1 thread on 2 cores, measured 2.2x slower all at once than alone:
    # share(4) = 2, excess = 1.1
    s = lambda k: time_sharing_slowdown(k, processes=4, threads=1, cores=2, measured=2.2)  # noqa: E731
    assert s(4) == pytest.approx(2.2)  # all compute at once: what was measured
    assert s(1) == pytest.approx(1.0)  # one alone (a 4-stage pipeline, 1 microbatch)
    assert s(2) == pytest.approx(1 * (1 + 0.1 * 1 / 3))  # two: a core each, a third of excess
    assert s(3.2) == pytest.approx(1.6 * (1 + 0.1 * 2.2 / 3))  # pp4, m4: 4·4/7 ... at 3.2
    assert s(8) == pytest.approx(4 * 1.1)  # 8 processes: extrapolated
    # as many processes as cores: no share, only the measured excess
    assert time_sharing_slowdown(2, 2, 1, 2, measured=1.05) == pytest.approx(1.05)


def _device():
    return DeviceSpec(name="cpu", kind="cpu", peak_flops={"float32": 1e11}, efficiency=1.0,
                      memory_bytes=1e10, memory_bandwidth_bytes_per_s=1e10,
                      op_flops={"matmul": 1e11})


def test_a_profile_prices_an_unmeasured_process_count_by_the_rule():
    link = LinkSpec(name="l", bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    profile = ClusterProfile(created="t", host="h", torch_version="x", backend="gloo", cores=2,
                             threads_per_process=1, device=_device(), links={4: link},
                             compute_slowdown={4: 2.2})
    assert profile.cluster(4).compute_slowdown == pytest.approx(2.2)
    assert profile.cluster(8).compute_slowdown == pytest.approx(4.4)
    assert profile.cluster(2).compute_slowdown == pytest.approx(1 + 0.1 / 3)


def test_a_pipeline_stage_waiting_for_its_input_holds_no_core():
    # the 3-D search prices a 4-stage pipeline of one microbatch on 4 processes sharing 2
    # cores with one process computing at a time: its layers cost 1/2.2 of what they cost
    # when all 4 compute at once
    import models
    from planner.profiled import profiled_graph
    from planner.search import CostCache, build

    link = LinkSpec(name="l", bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    shared = Cluster(device=_device(), devices_per_node=4, intra_node=link, inter_node=link,
                     compute_slowdown=2.2, cores=2, threads_per_device=1)
    x, _ = models.batch("mlp", 32, 0)
    graph, _ = profiled_graph(models.build("mlp"), shared, (x,), measure=False)
    alone = build(CostCache(graph, shared, "sgd"), pp=4, dp=1, tp=1, rows=32)
    together = build(CostCache(graph, shared.model_copy(update={"cores": 0}), "sgd"),
                     pp=4, dp=1, tp=1, rows=32)
    weighted = [(a, t) for layer, a, t in zip(graph.layers, alone.problem.layers,
                                               together.problem.layers) if layer.param_count]
    assert len(weighted) == 3  # the MLP's Linears (parameter-free ops are memory-bound)
    for a, t in weighted:
        assert t.microbatch_s[0] / a.microbatch_s[0] == pytest.approx(2.2)
    assert shared.computing_at_once(4) is shared  # every process computing: as measured
    # memory-bound work too: one streaming alone pays no share of the bandwidth, half the
    # processes a third of the excess (1 + 0.6·1/3), all of them what was measured
    streaming = shared.model_copy(update={"memory_slowdown": 1.6})
    assert streaming.computing_at_once(1).memory_slowdown == 1.0
    assert streaming.computing_at_once(2).memory_slowdown == pytest.approx(1.2)
    assert memory_sharing_slowdown(4, 4, 1.6) == memory_sharing_slowdown(6, 4, 1.6) == 1.6
    free = [p.microbatch_s[0] for p in build(CostCache(graph, streaming, "sgd"), pp=4, dp=1,
                                             tp=1, rows=32).problem.layers]
    assert free == pytest.approx([a.microbatch_s[0] for a in alone.problem.layers])

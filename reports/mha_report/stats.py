"""The numbers a report shows: medians over rounds, ratios from neighbouring measurements,
and the comparison of two runs with the U test Google Benchmark's compare.py uses.

Timings on shared machines drift by up to 30 % over minutes, so a ratio of two
implementations is never a ratio of their medians from different moments: it is taken round
by round (the k-th run of each, measured next to each other by mha_bench --rounds), and the
report gives the median of those ratios with their range.

The same holds for the gemm and layer families: gemm_rows (the fastest kernel against the
fastest library and peer) and layer_rows (the project's layer against the peer and the
fastest composed baseline) are made of the same paired ratios and spreads.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace
from typing import Any

from .results import (AnyShape, GemmShape, LayerShape, Results, Shape, is_composed, is_kernel,
                      is_library, is_own, is_peer)

# Debian's libbenchmark-tools installs compare.py's statistics here; they are reused, not
# rewritten (python3-scipy or the virtual environment's scipy provides mannwhitneyu).
GBENCH_PATH = "/usr/share/benchmark"


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    n: int

    @staticmethod
    def of(values: list[float]) -> "Spread | None":
        if not values:
            return None
        return Spread(statistics.median(values), min(values), max(values), len(values))

    def text(self, digits: int = 2) -> str:
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def paired_ratios(results: Results, shape: AnyShape, slower: str, faster: str) -> list[float]:
    """time(slower) / time(faster) round by round: > 1 when `faster` is faster. A round in
    which either failed is left out (the others still pair with their own round)."""
    a, b = results.round_times(shape, slower), results.round_times(shape, faster)
    return [a[k] / b[k] for k in sorted(a.keys() & b.keys()) if b[k] > 0]


def median_time(results: Results, shape: AnyShape, impl: str) -> float | None:
    times = results.times(shape, impl)
    return statistics.median(times) if times else None


def fastest(results: Results, shape: AnyShape, impls: list[str]) -> str | None:
    timed = [(t, i) for i in impls if (t := median_time(results, shape, i)) is not None]
    return min(timed)[1] if timed else None


@dataclass
class Row:
    impl: str
    ms: Spread
    gflops: Spread | None
    peak_frac: Spread | None
    gbps: Spread | None
    bw_frac: Spread | None
    vs_naive: Spread | None  # time(naive) / time(impl), round by round
    vs_best_peer: Spread | None  # time(best peer) / time(impl), round by round


def shape_rows(results: Results, shape: AnyShape) -> list[Row]:
    """Every implementation that ran this shape, fastest first."""
    impls = [i for i in results.impls() if results.times(shape, i)]
    best_peer = fastest(results, shape, [i for i in impls if is_peer(i)])
    rows = []
    for impl in impls:
        c = lambda key: Spread.of(results.counter(shape, impl, key))  # noqa: E731
        rows.append(Row(
            impl=impl,
            ms=Spread.of([t * 1e3 for t in results.times(shape, impl)]),
            gflops=c("GFLOPS"), peak_frac=c("peak_frac"), gbps=c("GBps"), bw_frac=c("bw_frac"),
            vs_naive=Spread.of(paired_ratios(results, shape, "naive", impl))
            if "naive" in impls else None,
            vs_best_peer=Spread.of(paired_ratios(results, shape, best_peer, impl))
            if best_peer else None,
        ))
    rows.sort(key=lambda r: r.ms.median)
    return rows


@dataclass
class Headline:
    shape: Shape
    kernel: str
    kernel_ms: float
    peer: str | None
    peer_ms: float | None
    speedup: Spread | None  # time(best peer) / time(best kernel), round by round


def headlines(results: Results) -> list[Headline]:
    """Per shape: the fastest kernel of this project against the fastest peer."""
    out = []
    for shape in results.shapes():
        impls = [i for i in results.impls() if results.times(shape, i)]
        kernel = fastest(results, shape, [i for i in impls if is_kernel(i)])
        if kernel is None:
            continue
        peer = fastest(results, shape, [i for i in impls if is_peer(i)])
        out.append(Headline(
            shape, kernel, median_time(results, shape, kernel) * 1e3, peer,
            median_time(results, shape, peer) * 1e3 if peer else None,
            Spread.of(paired_ratios(results, shape, peer, kernel)) if peer else None))
    return out


@dataclass
class Best:
    """The fastest implementation of one kind on a shape (None: none ran without an error;
    `failed` then says whether one ran with errors only)."""
    impl: str | None
    ms: Spread | None = None
    failed: bool = False


def best_of(results: Results, shape: AnyShape, impls: list[str]) -> Best:
    """The fastest of `impls` (by median time) on the shape, its milliseconds per call."""
    impl = fastest(results, shape, impls)
    if impl is None:
        return Best(None, None, any(results.failed(shape, i) for i in impls))
    return Best(impl, Spread.of([t * 1e3 for t in results.times(shape, impl)]))


def _speedup_over(results: Results, shape: AnyShape, other: Best, mine: Best
                  ) -> Spread | None:
    """time(other) / time(mine), round by round."""
    if other.impl is None or mine.impl is None:
        return None
    return Spread.of(paired_ratios(results, shape, other.impl, mine.impl))


def _counter(results: Results, shape: AnyShape, best: Best, key: str) -> Spread | None:
    return Spread.of(results.counter(shape, best.impl, key)) if best.impl else None


@dataclass
class GemmRow:
    """One GEMM shape: this project's fastest kernel against the fastest library and peer."""
    shape: GemmShape
    kernel: Best
    gflops: Spread | None
    peak_frac: Spread | None
    bw_frac: Spread | None  # the kernel's, when the weight is read from DRAM (M <= 16)
    library: Best
    library_gflops: Spread | None
    vs_library: Spread | None  # time(best library) / time(best kernel), round by round
    peer: Best
    vs_peer: Spread | None  # time(best peer) / time(best kernel), round by round


def gemm_rows(results: Results) -> list[GemmRow]:
    """Per GEMM shape (M, N, K, threads): the kernel, library and peer figures."""
    out = []
    for shape in results.gemm_shapes():
        impls = results.impls_of(shape)
        kernel = best_of(results, shape, [i for i in impls if is_own(shape, i)])
        library = best_of(results, shape, [i for i in impls if is_library(i)])
        peer = best_of(results, shape, [i for i in impls if is_peer(i)])
        out.append(GemmRow(
            shape, kernel, _counter(results, shape, kernel, "GFLOPS"),
            _counter(results, shape, kernel, "peak_frac"),
            _counter(results, shape, kernel, "bw_frac"),
            library, _counter(results, shape, library, "GFLOPS"),
            _speedup_over(results, shape, library, kernel),
            peer, _speedup_over(results, shape, peer, kernel)))
    return out


@dataclass
class LayerRow:
    """One layer shape: this project's layer against the peer and the composed baselines."""
    shape: LayerShape
    layer: Best  # the project's layer (named by its GEMM kernel)
    peer: Best
    vs_peer: Spread | None  # time(best peer) / time(layer), round by round
    composed: Best
    vs_composed: Spread | None  # time(best composed) / time(layer), round by round
    peak_frac: Spread | None  # the layer's
    bw_frac: Spread | None  # the layer's; decode only: weights + KV cache over DRAM bandwidth
    kv_cache_mib: float | None


def layer_rows(results: Results) -> list[LayerRow]:
    """Per layer shape (prefill or decode, d, H, Hkv, n or Lk, threads)."""
    out = []
    for shape in results.layer_shapes():
        impls = results.impls_of(shape)
        layer = best_of(results, shape, [i for i in impls if is_own(shape, i)])
        peer = best_of(results, shape, [i for i in impls if is_peer(i)])
        composed = best_of(results, shape, [i for i in impls if is_composed(i)])
        cache = [v for i in impls for v in results.counter(shape, i, "kv_cache_bytes")]
        out.append(LayerRow(
            shape, layer, peer, _speedup_over(results, shape, peer, layer),
            composed, _speedup_over(results, shape, composed, layer),
            _counter(results, shape, layer, "peak_frac"),
            _counter(results, shape, layer, "bw_frac"),
            max(cache) / 2**20 if cache else None))
    return out


def kv_head_groups(results: Results) -> list[list[LayerRow]]:
    """The decode layer shapes that differ only in Hkv (MHA, GQA, MQA), at least two Hkv a
    group, each group's rows with the most KV heads first."""
    groups: dict[tuple, list[LayerRow]] = {}
    for row in layer_rows(results):
        s = row.shape
        if s.step == "decode":
            key = (s.batch, s.d, s.heads, s.dim, s.new_tokens, s.kv_len, s.causal, s.threads,
                   s.kv)
            groups.setdefault(key, []).append(row)
    return [sorted(g, key=lambda r: -r.shape.kv_heads) for _, g in sorted(groups.items())
            if len({r.shape.kv_heads for r in g}) >= 2]


@dataclass
class KvRow:
    """One shape with K and V in a reduced type: its fastest kernel against the fastest on
    the same shape in fp32, and what the type costs in accuracy on the benchmark's inputs."""
    shape: Shape
    kernel: Best
    gbps: Spread | None  # the kernel's, in the bytes it reads (elements and scales)
    bw_frac: Spread | None
    fp32: Best  # the fastest kernel on the same shape with fp32 K and V
    vs_fp32: Spread | None  # time(fp32 best) / time(best), round by round
    own_vs_fp32: Spread | None  # the same kernel: time(its fp32) / time(reduced)
    peer: Best  # the fastest peer in the same precision, if any
    vs_peer: Spread | None
    err_max: float | None  # the quantization error: max |o - o_fp32| over the checked rows
    err_rms: float | None  # its RMS over the RMS output


def _paired_across(results: Results, slow: tuple[Shape, str], fast: tuple[Shape, str]
                   ) -> Spread | None:
    """time(slow) / time(fast) for two (shape, implementation) pairs, round by round."""
    a, b = results.round_times(*slow), results.round_times(*fast)
    return Spread.of([a[k] / b[k] for k in sorted(a.keys() & b.keys()) if b[k] > 0])


def kv_rows(results: Results) -> list[KvRow]:
    """Per shape with a reduced KV type, by family, shape and type."""
    order = {"f16": 0, "bf16": 1, "i8": 2}
    shapes = sorted((s for s in results.shapes() if s.kv != "f32"),
                    key=lambda s: (s.family, replace(s, kv="f32"), order.get(s.kv, 9)))
    out = []
    for shape in shapes:
        impls = results.impls_of(shape)
        kernel = best_of(results, shape, [i for i in impls if is_kernel(i)])
        fp32_shape = replace(shape, kv="f32")
        fp32 = best_of(results, fp32_shape,
                       [i for i in results.impls_of(fp32_shape) if is_kernel(i)])
        peer = best_of(results, shape, [i for i in impls if is_peer(i)])
        errors = {key: [v for i in impls for v in results.counter(shape, i, key)]
                  for key in ("kv_err_max", "kv_err_rms")}
        out.append(KvRow(
            shape, kernel, _counter(results, shape, kernel, "GBps"),
            _counter(results, shape, kernel, "bw_frac"), fp32,
            _paired_across(results, (fp32_shape, fp32.impl), (shape, kernel.impl))
            if fp32.impl and kernel.impl else None,
            _paired_across(results, (fp32_shape, kernel.impl), (shape, kernel.impl))
            if kernel.impl else None,
            peer, _speedup_over(results, shape, peer, kernel),
            max(errors["kv_err_max"]) if errors["kv_err_max"] else None,
            max(errors["kv_err_rms"]) if errors["kv_err_rms"] else None))
    return out


@dataclass
class VariantRow:
    """One shape with an attention variant (a ragged batch, sinks, a sliding window, soft-capped
    logits, ALiBi): its fastest kernel, that kernel's time on the same shape without the variant
    when the run has it, and the fastest peer that can express the variant (the others are
    absent)."""
    shape: Shape
    variant: str
    kernel: Best
    plain: Best  # the same kernel on the shape without the variant
    vs_plain: Spread | None  # time(variant) / time(plain), the same kernel, round by round
    peer: Best
    vs_peer: Spread | None


def variant_rows(results: Results) -> list[VariantRow]:
    """Per shape with a variant, in the run's order."""
    out = []
    for shape in results.shapes():
        names = ((["ragged batch"] if shape.family == "ragged" else [])
                 + (["sinks"] if shape.sinks else [])
                 + ([f"window {shape.window}"] if shape.window else [])
                 + ([f"softcap {shape.softcap:g}"] if shape.softcap else [])
                 + (["ALiBi"] if shape.alibi else []))
        if not names:
            continue
        impls = results.impls_of(shape)
        kernel = best_of(results, shape, [i for i in impls if is_kernel(i)])
        plain_shape = replace(shape, sinks=False, window=0, softcap=0.0, alibi=False)
        plain, vs_plain = Best(None), None
        if (shape.family != "ragged" and kernel.impl is not None
                and kernel.impl in results.impls_of(plain_shape)):
            plain = Best(kernel.impl, Spread.of([t * 1e3 for t in
                                                 results.times(plain_shape, kernel.impl)]))
            vs_plain = _paired_across(results, (shape, kernel.impl), (plain_shape, kernel.impl))
        peer = best_of(results, shape, [i for i in impls if is_peer(i)])
        out.append(VariantRow(shape, ", ".join(names), kernel, plain, vs_plain, peer,
                              _speedup_over(results, shape, peer, kernel)))
    return out


@dataclass
class Change:
    name: str
    old_ms: float
    new_ms: float
    ratio: float  # median new / old time: > 1 is slower
    pvalue: float | None  # U test of the time samples, None below 2 repetitions a side
    verdict: str  # "regression", "improvement", "same" or "untested"


def compare(old: Results, new: Results, alpha: float = 0.05, threshold: float = 0.05
            ) -> list[Change]:
    """Every benchmark in both runs but the cliff sweep's. A change is a regression (improvement) when the median
    time rose (fell) by more than `threshold` and the U test rejects equal distributions at
    `alpha`; below two repetitions on either side it is 'untested'."""
    report = _gbench_report()
    diff = report.get_difference_report(_iterations(old.raw), _iterations(new.raw), utest=True)
    out = []
    for entry in diff:
        if entry["name"] == "OVERALL_GEOMEAN" or not entry["measurements"]:
            continue
        if entry["name"].startswith("cliffs/"):
            continue  # the sweep's points: summarized on their own (cliffs.py)
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[entry["time_unit"]]
        old_ms = statistics.median(m["real_time"] for m in entry["measurements"]) * unit
        new_ms = statistics.median(m["real_time_other"] for m in entry["measurements"]) * unit
        ratio = new_ms / old_ms if old_ms > 0 else float("inf")
        pvalue = entry["utest"].get("time_pvalue") if entry["utest"] else None
        if pvalue is None:
            verdict = "untested"
        elif pvalue < alpha and ratio > 1 + threshold:
            verdict = "regression"
        elif pvalue < alpha and ratio < 1 - threshold:
            verdict = "improvement"
        else:
            verdict = "same"
        out.append(Change(entry["name"], old_ms, new_ms, ratio, pvalue, verdict))
    return out


def _iterations(raw: dict[str, Any]) -> dict[str, Any]:
    """Only the runs (no aggregates), without errored ones: what the U test should see."""
    return {"context": raw.get("context", {}),
            "benchmarks": [b for b in raw.get("benchmarks", [])
                           if b.get("run_type", "iteration") == "iteration"
                           and not b.get("error_occurred")]}


def _gbench_report() -> Any:
    if GBENCH_PATH not in sys.path:
        sys.path.append(GBENCH_PATH)
    try:
        from gbench import report  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(f"comparing runs needs Google Benchmark's tools in {GBENCH_PATH} "
                           f"(Debian: libbenchmark-tools) and scipy: {e}") from e
    return report

"""The cliff sweep's numbers: per kernel and phase, each point's fraction of its roof, the
median over the grid, and the worst point with its ratio to that median.

A point's figure is its best round: the rounds are spread over the whole sweep, and the host's
other tenants only ever slow a call down, so a burst of them would otherwise pass for a cliff.
Its roof is the binding limit (mha_bench's roof_frac): the FMA peak, or for a decode whose K
and V bytes at the bandwidth of their level take longer, that bandwidth. Prefill and decode
are separate grids: a decode of one query head per KV head is bound by bandwidth, a prefill
by the FMA peak, and their medians say different things.

The bar a kernel's worst point must clear, as a fraction of its median: 0.7 for the
hand-written kernels, 0.6 for the portable ones (a registry name <library>-<target>).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .results import CliffShape, Results

HAND_WRITTEN_BAR = 0.7
PORTABLE_BAR = 0.6
PHASES = ("prefill", "decode")


def portable(kernel: str) -> bool:
    return "-" in kernel


def bar(kernel: str) -> float:
    return PORTABLE_BAR if portable(kernel) else HAND_WRITTEN_BAR


@dataclass(frozen=True)
class Point:
    shape: CliffShape
    roof_frac: float  # the best round's
    gflops: float  # the same round's


@dataclass(frozen=True)
class Summary:
    """One kernel's grid of one phase."""
    kernel: str
    phase: str
    points: list[Point]
    median: float  # of the points' roof_frac
    worst: Point

    @property
    def ratio(self) -> float:
        return self.worst.roof_frac / self.median if self.median > 0 else 0.0

    @property
    def bar(self) -> float:
        return bar(self.kernel)

    @property
    def passes(self) -> bool:
        return self.ratio >= self.bar


def points(results: Results, kernel: str, phase: str) -> list[Point]:
    """The kernel's points of one phase, each at its best round (rounds with an error left
    out; a point with no good round is left out)."""
    best: dict[CliffShape, Point] = {}
    for r in results.runs:
        shape = r.shape
        if (r.impl != kernel or r.error or not isinstance(shape, CliffShape)
                or shape.phase != phase or "roof_frac" not in r.counters):
            continue
        p = Point(shape, r.counters["roof_frac"], r.counters.get("GFLOPS", 0.0))
        if shape not in best or p.roof_frac > best[shape].roof_frac:
            best[shape] = p
    return sorted(best.values(), key=lambda p: p.shape)


def kernels(results: Results) -> list[str]:
    """The kernels the sweep ran, in the order they first ran."""
    seen: dict[str, None] = {}
    for r in results.runs:
        if isinstance(r.shape, CliffShape):
            seen.setdefault(r.impl, None)
    return list(seen)


def configs(results: Results) -> list[str]:
    """The cache configurations, in the order they first ran (native first)."""
    seen: dict[str, None] = {}
    for r in results.runs:
        if isinstance(r.shape, CliffShape):
            seen.setdefault(r.shape.caches, None)
    return list(seen)


def summaries(results: Results) -> list[Summary]:
    out = []
    for kernel in kernels(results):
        for phase in PHASES:
            ps = points(results, kernel, phase)
            if not ps:
                continue
            median = statistics.median(p.roof_frac for p in ps)
            out.append(Summary(kernel, phase, ps, median, min(ps, key=lambda p: p.roof_frac)))
    return out


def worst_line(s: Summary) -> str:
    """'avx2 prefill: worst g=4 D=16 L=512, caches 32K-256K at 0.495 of its roof, 0.63x the
    median 0.785 (bar 0.7: below)'."""
    w = s.worst
    verdict = "meets it" if s.passes else "below"
    return (f"`{s.kernel}` {s.phase}: worst point {w.shape.label().split(' ', 1)[1]} at "
            f"{w.roof_frac:.3f} of its roof, {s.ratio:.2f}x the kernel's {s.phase} median "
            f"{s.median:.3f} (bar {s.bar:.1f}: {verdict})")

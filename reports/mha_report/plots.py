"""The report's figures: one question each, a title that states it, units on both axes, log
scales where lengths span decades, the machine's limits drawn as lines, and kernels, composed
baselines and framework peers in three visibly different styles (solid with filled circles,
dotted with crosses, dashed with open squares)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from . import cliffs  # noqa: E402
from .results import Results, Shape, is_kernel, is_peer, sharing  # noqa: E402
from .stats import Best, Change, kv_head_groups  # noqa: E402

_COLORS = plt.get_cmap("tab10").colors


def _style(impl: str, index: int) -> dict:
    color = _COLORS[index % len(_COLORS)]
    if is_peer(impl):
        return dict(color=color, linestyle="--", marker="s", markerfacecolor="white",
                    linewidth=1.6)
    if is_kernel(impl):
        return dict(color=color, linestyle="-", marker="o", linewidth=2.2)
    return dict(color=color, linestyle=":", marker="x", linewidth=1.6)


def _limit(ax: Axes, y: float | None, text: str) -> None:
    if y:
        ax.axhline(y, color="black", linewidth=1.0, linestyle=(0, (6, 3)), alpha=0.7)
        ax.annotate(text, (0.005, y), xycoords=("axes fraction", "data"), fontsize=8,
                    va="bottom", ha="left", alpha=0.8)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _series(results: Results, shapes: list[Shape], x: Callable[[Shape], float],
            y: Callable[[Shape, str], float | None]) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for impl in results.impls():
        xs, ys = [], []
        for s in sorted(shapes, key=x):
            v = y(s, impl)
            if v is not None:
                xs.append(x(s))
                ys.append(v)
        if xs:
            out[impl] = (xs, ys)
    return out


def _plot_series(ax: Axes, series: dict[str, tuple[list[float], list[float]]],
                 order: list[str]) -> None:
    for impl, (xs, ys) in series.items():
        ax.plot(xs, ys, label=impl, **_style(impl, order.index(impl)))


def _legend(fig: plt.Figure, ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize=8, frameon=False)


def _plain(s: Shape) -> bool:
    """Without an attention variant (sinks, a sliding window, a soft-cap, ALiBi): the variants
    have a section of their own, and a variant's point beside its plain twin would fold a sweep
    back on itself."""
    return not s.sinks and not s.window and not s.softcap and not s.alibi


def _sweep(results: Results, keep: Callable[[Shape], bool], fixed: Callable[[Shape], tuple],
           varied: Callable[[Shape], object]) -> tuple[tuple, list[Shape]] | None:
    """The 1-thread shapes that `keep` selects, at the value of `fixed` (the sweep's fixed
    parameters) where `varied` takes the most values (ties: the largest value, e.g. the most
    heads); None unless it takes at least two."""
    shapes = [s for s in results.shapes() if s.threads == 1 and _plain(s) and keep(s)]
    spans: dict[tuple, set] = {}
    for s in shapes:
        spans.setdefault(fixed(s), set()).add(varied(s))
    if not spans:
        return None
    value = max(spans, key=lambda v: (len(spans[v]), v))
    if len(spans[value]) < 2:
        return None
    return value, [s for s in shapes if fixed(s) == value]


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cpu(results: Results) -> str:
    return results.context.get("mha_cpu_model", "unknown CPU")


def prefill_vs_length(results: Results, path: Path) -> Path | None:
    """Does throughput hold up as the sequence grows? GFLOP/s against L, causal and not."""
    sweep = _sweep(results, lambda s: s.family == "prefill" and s.q_len == s.kv_len
                   and s.kv == "f32",
                   lambda s: (s.heads, s.kv_heads, s.dim), lambda s: s.q_len)
    if sweep is None:
        return None
    fixed, shapes = sweep
    order = results.impls()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True, layout="constrained")
    for ax, causal in zip(axes, (False, True)):
        sel = [s for s in shapes if s.causal == causal]
        _plot_series(ax, _series(results, sel, lambda s: s.q_len,
                                 lambda s, i: _median(results.counter(s, i, "GFLOPS"))), order)
        _limit(ax, results.context_float("probe_fma_gflops_1t"),
               f"FMA peak ({results.context.get('probe_fma_isa', '')}, 1 core)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L = Lq = Lk (tokens)")
        ax.set_title("causal (visible pairs counted)" if causal else "not causal")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GFLOP/s")
    h, hkv, d = fixed
    fig.suptitle(f"Prefill throughput against sequence length (H={h} Hkv={hkv} D={d}, "
                 f"1 thread, {_cpu(results)})")
    _legend(fig, axes[0])
    return _save(fig, path)


def decode_vs_length(results: Results, path: Path) -> Path | None:
    """Does a decode step stream the KV cache at the memory's speed, at every cache size?"""
    sweep = _sweep(results, lambda s: s.family == "decode" and s.kv == "f32",
                   lambda s: (s.heads, s.kv_heads, s.dim), lambda s: s.kv_len)
    if sweep is None:
        return None
    fixed, shapes = sweep
    fig, ax = plt.subplots(figsize=(11, 4.8), layout="constrained")
    _plot_series(ax, _series(results, shapes, lambda s: s.kv_bytes() / 2**20,
                             lambda s, i: _median(results.counter(s, i, "GBps"))),
                 results.impls())
    for level in ("l2", "l3", "dram"):
        _limit(ax, results.context_float(f"probe_{level}_gbps_1t"),
               f"{level.upper()} read bandwidth (1 core)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV cache read per step (MiB)")
    ax.set_ylabel("KV cache bytes per second (GB/s, log)")
    ax.grid(True, which="both", alpha=0.3)
    h, hkv, d = fixed
    ax.set_title(f"Decode: KV-cache read rate against cache size (H={h} Hkv={hkv} D={d}, "
                 f"1 thread, {_cpu(results)})")
    _legend(fig, ax)
    return _save(fig, path)


def decode_vs_kv_heads(results: Results, path: Path) -> Path | None:
    """What does sharing KV heads buy? Time per decode step against Hkv, beside the cache."""
    sweep = _sweep(results, lambda s: s.family == "decode" and s.kv == "f32",
                   lambda s: (s.heads, s.kv_len, s.dim), lambda s: s.kv_heads)
    if sweep is None:
        return None
    fixed, shapes = sweep
    fig, ax = plt.subplots(figsize=(11, 4.8), layout="constrained")
    kv = {s.kv_heads: s.kv_bytes() / 2**20 for s in shapes}
    ax2 = ax.twinx()
    xs = sorted(kv, reverse=True)
    ax2.bar(range(len(xs)), [kv[x] for x in xs], color="0.85", width=0.5, zorder=0,
            label="KV cache (MiB, right axis)")
    ax2.set_ylabel("KV cache per sequence (MiB)")
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    position = {x: i for i, x in enumerate(xs)}
    _plot_series(ax, _series(results, shapes, lambda s: position[s.kv_heads],
                             lambda s, i: _median([t * 1e3 for t in results.times(s, i)])),
                 results.impls())
    h, lk, d = fixed
    ax.set_xticks(range(len(xs)),
                  [f"Hkv={x}\n{'MHA' if x == h else ('MQA' if x == 1 else f'GQA g={h // x}')}"
                   for x in xs])
    ax.set_yscale("log")
    ax.set_ylabel("time per decode step (ms, log)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.set_title(f"Decode: time per step as query heads share KV heads (H={h} Lk={lk} D={d}, "
                 f"1 thread, {_cpu(results)})")
    _legend(fig, ax)
    return _save(fig, path)


def heads_sweep(results: Results, path: Path) -> Path | None:
    """At a fixed model width d = H D the work is the same: does the time stay flat in H?"""
    sweep = _sweep(results, lambda s: s.family == "heads", lambda s: (s.heads * s.dim, s.q_len),
                   lambda s: s.heads)
    if sweep is None:
        return None
    fixed, shapes = sweep
    fig, ax = plt.subplots(figsize=(11, 4.8), layout="constrained")
    _plot_series(ax, _series(results, shapes, lambda s: s.heads,
                             lambda s, i: _median([t * 1e3 for t in results.times(s, i)])),
                 results.impls())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({s.heads for s in shapes}),
                  [f"H={s.heads}\nD={s.dim}" for s in sorted(shapes, key=lambda s: s.heads)])
    ax.set_xlabel("heads H (head width D = d / H)")
    ax.set_ylabel("time per call (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"Head sweep at fixed model width d={fixed[0]}, L={fixed[1]}: same FLOPs, "
                 f"1 thread, {_cpu(results)}")
    _legend(fig, ax)
    return _save(fig, path)


def roofline(results: Results, path: Path) -> Path | None:
    """How close is every result to the roof of its arithmetic intensity?"""
    shapes = [s for s in results.shapes() if s.threads == 1 and s.kv == "f32" and _plain(s)]
    if not shapes:
        return None
    fig, ax = plt.subplots(figsize=(11, 5.2), layout="constrained")
    order = results.impls()
    everywhere: list[float] = []
    for impl in order:
        xs, ys = [], []
        for s in shapes:
            g = _median(results.counter(s, impl, "GFLOPS"))
            if g:
                flops_per_call = g * 1e9 * _median(results.times(s, impl))
                xs.append(flops_per_call / s.io_bytes())
                ys.append(g)
        everywhere += xs
        if xs:
            st = _style(impl, order.index(impl))
            st["linestyle"] = "none"
            ax.plot(xs, ys, label=impl, **st)
    if not everywhere:
        plt.close(fig)
        return None
    peak = results.context_float("probe_fma_gflops_1t")
    lo, hi = min(everywhere) / 3, max(everywhere) * 3
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for level, style in (("dram", "-"), ("l2", "--")):
        bw = results.context_float(f"probe_{level}_gbps_1t")
        if bw and peak:
            ax.plot(grid, [min(peak, bw * x) for x in grid], color="black", linestyle=style,
                    linewidth=1.0, alpha=0.7, label=f"roof: FMA peak, {level.upper()} {bw:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of unique q, k, v, o)")
    ax.set_ylabel("GFLOP/s (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"Roofline: every 1-thread result under the measured roofs ({_cpu(results)})")
    _legend(fig, ax)
    return _save(fig, path)


def cliff_heat_map(results: Results, kernel: str, path: Path) -> Path | None:
    """Does the kernel hold its speed on every cache size, head width and group? One panel
    per phase and group g: cache configuration x head width, each cell the point's fraction
    of its roof (best round), on one colour scale for the figure; the worst point of each
    phase is boxed."""
    summaries = [s for s in cliffs.summaries(results) if s.kernel == kernel]
    if not summaries:
        return None
    configs = cliffs.configs(results)
    groups = sorted({p.shape.group for s in summaries for p in s.points})
    dims = sorted({p.shape.dim for s in summaries for p in s.points})
    top = max(p.roof_frac for s in summaries for p in s.points)
    fig, axes = plt.subplots(len(summaries), len(groups), squeeze=False, sharex=True,
                             sharey=True, figsize=(3.1 * len(groups) + 1.5,
                                                   0.42 * len(configs) * len(summaries) + 1.8),
                             layout="constrained")
    image = None
    for row, summary in enumerate(summaries):
        at = {(p.shape.caches, p.shape.group, p.shape.dim): p for p in summary.points}
        for col, g in enumerate(groups):
            ax = axes[row][col]
            grid = [[at[(c, g, d)].roof_frac if (c, g, d) in at else float("nan") for d in dims]
                    for c in configs]
            image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
            for i, c in enumerate(configs):
                for j, d in enumerate(dims):
                    if (c, g, d) in at:
                        v = at[(c, g, d)].roof_frac
                        text = f"{v:.2f}"  # ".83", "1.04": the leading 0 left out
                        ax.text(j, i, text[1:] if text.startswith("0") else text, ha="center",
                                va="center", fontsize=6,
                                color="white" if v < 0.55 * top else "black")
            w = summary.worst.shape
            if w.group == g:
                ax.add_patch(plt.Rectangle((dims.index(w.dim) - 0.5, configs.index(w.caches) - 0.5),
                                           1, 1, fill=False, edgecolor="red", linewidth=2))
            ax.set_title(f"{summary.phase}, g={g}", fontsize=9)
            ax.set_xticks(range(len(dims)), [str(d) for d in dims], fontsize=7)
            ax.set_yticks(range(len(configs)), configs, fontsize=7)
            if row == len(summaries) - 1:
                ax.set_xlabel("head width D")
            if col == 0:
                ax.set_ylabel("caches (L1d-L2)")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="fraction of the roof (FMA peak or bandwidth)")
    worst = "; ".join(f"{s.phase} worst {s.worst.roof_frac:.2f} = {s.ratio:.2f}x median "
                      f"{s.median:.2f}" for s in summaries)
    fig.suptitle(f"Cliff sweep, {kernel} on {_cpu(results)}, 1 thread: {worst}", fontsize=10)
    return _save(fig, path)


def _bar_label(what: str, bests: list[Best]) -> str:
    names = sorted({b.impl for b in bests if b.impl})
    return f"{what} ({', '.join(names)})" if names else what


def layer_decode_vs_kv_heads(results: Results, path: Path) -> Path | None:
    """What does sharing KV heads buy the whole layer? Time per decode step against Hkv, the
    project's layer beside the peer and the best composed baseline (one panel per decode
    shape that ran at several Hkv; whiskers: the range over rounds)."""
    groups = kv_head_groups(results)
    if not groups:
        return None
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 2.4, 4.2 * rows),
                             layout="constrained", squeeze=False)
    kinds = (("this project's layer", lambda r: r.layer,
              dict(color=_COLORS[0], edgecolor=_COLORS[0])),
             ("peer", lambda r: r.peer,
              dict(color="white", edgecolor=_COLORS[1], linestyle="--", linewidth=1.6)),
             ("best composed", lambda r: r.composed,
              dict(color="white", edgecolor=_COLORS[2], hatch="xx", linewidth=1.0)))
    width = 0.26
    for ax, group in zip(axes.flat, groups):
        xs = range(len(group))
        for k, (what, best, style) in enumerate(kinds):
            bests = [best(r) for r in group]
            at = [x + (k - 1) * width for x, b in zip(xs, bests) if b.ms]
            ms = [b.ms for b in bests if b.ms]
            if not ms:
                continue
            ax.bar(at, [m.median for m in ms], width=width, label=_bar_label(what, bests),
                   yerr=[[m.median - m.low for m in ms], [m.high - m.median for m in ms]],
                   error_kw=dict(ecolor="black", capsize=2, linewidth=0.8), **style)
        ax.set_xticks(list(xs), [
            f"Hkv={r.shape.kv_heads}\n{sharing(r.shape.heads, r.shape.kv_heads)}"
            + (f"\n{r.kv_cache_mib:.3g} MiB cache" if r.kv_cache_mib is not None else "")
            for r in group], fontsize=8)
        ax.set_ylabel("time per decode step (ms)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(group[0].shape.label(kv_heads=False), fontsize=9)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle(f"Layer decode: time per step as query heads share KV heads ({_cpu(results)})")
    _legend(fig, axes.flat[0])
    return _save(fig, path)


def comparison(changes: list[Change], path: Path, old: str, new: str,
               threshold: float = 0.05) -> Path | None:
    """Which benchmarks got slower or faster between two runs, and is it more than noise?
    Only those whose median moved by more than `threshold` are drawn."""
    moved = sorted((c for c in changes if abs(c.ratio - 1) > threshold), key=lambda c: c.ratio)
    if not moved:
        return None
    colors = {"regression": "tab:red", "improvement": "tab:green", "same": "0.6",
              "untested": "0.85"}
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.22 * len(moved) + 1.4)), layout="constrained")
    ax.barh(range(len(moved)), [c.ratio - 1 for c in moved], left=1,
            color=[colors[c.verdict] for c in moved])
    ax.set_yticks(range(len(moved)), [c.name.replace("/real_time", "").replace(
        "/manual_time", "") for c in moved], fontsize=7)
    ax.axvline(1, color="black", linewidth=1)
    ax.set_xlabel(f"time ratio {new} / {old} (> 1: slower)")
    ax.legend(handles=[Patch(color=c, label=v if v != "same" else "not significant")
                       for v, c in colors.items()], fontsize=8, loc="lower right")
    ax.set_title(f"Benchmarks whose median time moved by more than {threshold:.0%}: "
                 f"{len(moved)} of {len(changes)} (U test at p < 0.05)")
    return _save(fig, path)

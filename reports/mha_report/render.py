"""The report itself: Markdown with PNG plots beside it, and one self-contained HTML page
(plots embedded) with the same content."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import cliffs, plots
from .results import (GEMM_LIBRARIES, GemmShape, LayerShape, Results, Shape, is_composed,
                      is_kernel, is_library, is_peer, sharing)
from .stats import (Best, Change, GemmRow, Headline, KvRow, LayerRow, Row, Spread, VariantRow,
                    compare, gemm_rows, headlines, kv_head_groups, kv_rows, layer_rows,
                    shape_rows, variant_rows)


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |",
                 "| " + " | ".join("---" for _ in self.header) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)

    def text(self) -> str:
        """Aligned plain text, for the terminal."""
        cells = [self.header] + self.rows
        widths = [max(len(_plain(r[i])) for r in cells) for i in range(len(self.header))]
        return "\n".join("  ".join(_plain(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                         for r in cells)

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(_plain(h))}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in r) + "</tr>"
                       for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _plain(cell: str) -> str:
    return cell.replace("**", "").replace("`", "")


def _html_cell(cell: str) -> str:
    escaped = html.escape(cell)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


@dataclass
class Report:
    title: str
    blocks: list[tuple[str, object]] = field(default_factory=list)  # (kind, content)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", (level, text)))

    def para(self, text: str) -> None:
        self.blocks.append(("para", text))

    def table(self, t: Table) -> None:
        self.blocks.append(("table", t))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("image", (path, alt)))

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for kind, content in self.blocks:
            if kind == "heading":
                level, text = content
                out += ["#" * level + " " + text, ""]
            elif kind == "para":
                out += [str(content), ""]
            elif kind == "table":
                out += [content.markdown(), ""]
            elif kind == "image":
                path, alt = content
                out += [f"![{alt}]({path.name})", ""]
        return "\n".join(out)

    def html(self) -> str:
        parts = [f"<h1>{html.escape(self.title)}</h1>"]
        for kind, content in self.blocks:
            if kind == "heading":
                level, text = content
                parts.append(f"<h{level}>{html.escape(text)}</h{level}>")
            elif kind == "para":
                parts.append(f"<p>{_html_cell(str(content))}</p>")
            elif kind == "table":
                parts.append(content.html())
            elif kind == "image":
                path, alt = content
                data = base64.b64encode(path.read_bytes()).decode("ascii")
                parts.append(f'<p><img alt="{html.escape(alt)}" '
                             f'src="data:image/png;base64,{data}"></p>')
        style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
                 "table{border-collapse:collapse;margin:1em 0;font-size:13px}"
                 "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}"
                 "th:first-child,td:first-child{text-align:left}img{max-width:100%}"
                 "code{background:#f4f4f4}")
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
                f"<title>{html.escape(self.title)}</title><style>{style}</style></head>"
                f"<body>{''.join(parts)}</body></html>")


def _fmt(s: Spread | None, digits: int = 2) -> str:
    return s.text(digits) if s else ""


def _speedup(s: Spread | None) -> str:
    if s is None:
        return ""
    text = s.text(2) + "x"
    return f"**{text}**" if s.median >= 1 else text


def machine_table(r: Results) -> Table:
    c = r.context
    rows = [
        ["CPU", c.get("mha_cpu_model", "?") + (f" ({c['mha_cpu_id']})" if "mha_cpu_id" in c else "")],
        ["cores used", c.get("mha_cores", "?")],
        ["best kernel (ISA)", f"{c.get('mha_best_kernel', '?')} ({c.get('mha_best_isa', '?')})"],
        ["FMA peak, 1 core / all (GFLOP/s)",
         f"{c.get('probe_fma_gflops_1t', '?')} / {c.get('probe_fma_gflops_all', '?')} "
         f"({c.get('probe_fma_isa', '?')})"],
    ]
    for level in ("l1", "l2", "l3", "dram"):
        one, all_ = c.get(f"probe_{level}_gbps_1t"), c.get(f"probe_{level}_gbps_all")
        if one:
            rows.append([f"{level.upper()} read, 1 core / all (GB/s)", f"{one} / {all_}"])
    caches = ", ".join(f"{n} {int(c[k]) // 1024} KiB" for n, k in
                       (("L1d", "cache_l1d_bytes"), ("L2", "cache_l2_bytes"),
                        ("L3", "cache_l3_bytes")) if c.get(k) and int(c[k]) > 0)
    rows += [["caches", caches],
             ["compiler", c.get("mha_compiler", "?")],
             ["commit", f"`{c.get('mha_commit', '?')}`"],
             ["date", c.get("date", "?")],
             ["size", c.get("mha_size", "?")]]
    for key in sorted(c):  # the peers that ran are in the Peers table
        if key.startswith("peer_skipped_"):
            rows.append([key[len("peer_skipped_"):] + " (skipped)", c[key]])
    return Table(["", ""], rows)


def peer_overheads(r: Results) -> dict[str, float]:
    """Each peer's time per call on a trivial problem (mha_bench's peer_overhead), in us."""
    out = {}
    for key, value in r.context.items():
        if key.startswith("peer-") and key.endswith("_overhead_us"):
            out[key[: -len("_overhead_us")]] = float(value)
    return out


def peers_table(r: Results) -> Table | None:
    """How each peer was run, from the context: version, form, per-call overhead."""
    c = r.context
    names = sorted(k[: -len("_version")] for k in c if k.startswith("peer-")
                   and k.endswith("_version"))
    if not names:
        return None
    overheads = peer_overheads(r)
    rows = [[f"`{n}`", c[f"{n}_version"], c.get(f"{n}_how", ""),
             f"{overheads[n]:.1f}" if n in overheads else ""] for n in names]
    return Table(["peer", "version", "how it is run", "per-call overhead (us)"], rows)


def headline_table(hs: list[Headline], overheads: dict[str, float] | None = None) -> Table:
    """The summary; a best peer's time under a millisecond carries its per-call overhead."""
    overheads = overheads or {}
    rows = []
    for h in hs:
        peer_ms = f"{h.peer_ms:.3f}" if h.peer_ms else ""
        if h.peer_ms and h.peer_ms < 1.0 and h.peer in overheads:
            peer_ms += f" (overhead {overheads[h.peer] / 1000:.3f})"
        rows.append([h.shape.family, h.shape.label(), f"`{h.kernel}`", f"{h.kernel_ms:.3f}",
                     f"`{h.peer}`" if h.peer else "", peer_ms, _speedup(h.speedup)])
    return Table(["family", "shape", "best kernel", "ms", "best peer", "ms",
                  "speedup over best peer"], rows)


GEMM_TITLE = "GEMM: the fastest kernel against the fastest library and peer"
LAYER_TITLE = "Layer: the project's attention layer against PyTorch and the composed baselines"


def attention_kind(impl: str) -> str:
    return "peer" if is_peer(impl) else ("kernel" if is_kernel(impl) else "baseline")


def gemm_kind(impl: str) -> str:
    return "peer" if is_peer(impl) else ("library" if is_library(impl) else "kernel")


def layer_kind(impl: str) -> str:
    return "peer" if is_peer(impl) else ("baseline" if is_composed(impl) else "layer")


def shape_table(rows: list[Row], decode: bool, kind: Callable[[str], str] = attention_kind,
                naive: bool = True) -> Table:
    """Every implementation of one shape; `decode`: with the bandwidth columns; `naive`: with
    the speedup over the naive kernel (attention)."""
    header = ["implementation", "ms", "GFLOP/s", "of FMA peak"]
    if decode:
        header += ["GB/s", "of bandwidth"]
    header += ["speedup over naive"] if naive else []
    header += ["speedup over best peer"]
    out = []
    for r in rows:
        cells = [f"`{r.impl}` ({kind(r.impl)})", _fmt(r.ms, 3), _fmt(r.gflops, 1),
                 _fmt(r.peak_frac, 3)]
        if decode:
            cells += [_fmt(r.gbps, 1), _fmt(r.bw_frac, 3)]
        cells += [_speedup(r.vs_naive)] if naive else []
        cells += [_speedup(r.vs_best_peer)]
        out.append(cells)
    return Table(header, out)


def _name(b: Best) -> str:
    """The implementation's name, 'error' if it only failed (see the Errors table)."""
    return f"`{b.impl}`" if b.impl else ("error" if b.failed else "")


def _mib(mib: float | None) -> str:
    return f"{mib:.3g}" if mib is not None else ""


def gemm_table(rows: list[GemmRow]) -> Table:
    """Per GEMM shape: the best kernel (its rate, and for M <= 16 its fraction of the DRAM
    bandwidth), the best library and the peer, with the speedups over them."""
    header = ["shape", "best kernel", "ms", "GFLOP/s", "of FMA peak", "of DRAM bandwidth",
              "best library", "GFLOP/s", "speedup over library", "peer", "ms",
              "speedup over peer"]
    out = []
    for r in rows:
        out.append([r.shape.label(), _name(r.kernel), _fmt(r.kernel.ms, 3), _fmt(r.gflops, 1),
                    _fmt(r.peak_frac, 3), _fmt(r.bw_frac, 3) if r.shape.m <= 16 else "",
                    _name(r.library), _fmt(r.library_gflops, 1), _speedup(r.vs_library),
                    _name(r.peer), _fmt(r.peer.ms, 3), _speedup(r.vs_peer)])
    return Table(header, out)


def layer_table(rows: list[LayerRow]) -> Table:
    """Per layer shape: the project's layer against the peer and the best composed baseline,
    its fraction of the FMA peak (prefill) or of the DRAM bandwidth (decode), the cache."""
    header = ["step", "shape", "layer", "ms", "peer", "ms", "speedup over peer",
              "best composed", "ms", "speedup over composed", "of FMA peak",
              "of DRAM bandwidth", "KV cache MiB"]
    out = []
    for r in rows:
        decode = r.shape.step == "decode"
        out.append([r.shape.step, r.shape.label(), _name(r.layer), _fmt(r.layer.ms, 3),
                    _name(r.peer), _fmt(r.peer.ms, 3), _speedup(r.vs_peer),
                    _name(r.composed), _fmt(r.composed.ms, 3), _speedup(r.vs_composed),
                    "" if decode else _fmt(r.peak_frac, 3), _fmt(r.bw_frac, 3) if decode else "",
                    _mib(r.kv_cache_mib)])
    return Table(header, out)


def kv_heads_table(group: list[LayerRow]) -> Table:
    """One decode shape at every Hkv it ran: the cache, the layer's, the peer's and the best
    composed baseline's time per step."""
    def named(what: str, bests: list[Best]) -> str:
        names = {b.impl for b in bests if b.impl}
        return f"`{names.pop()}` ms" if len(names) == 1 else f"{what} ms"
    header = ["Hkv", "KV cache MiB", named("layer", [r.layer for r in group]),
              named("peer", [r.peer for r in group]), "speedup over peer",
              "best composed ms"]
    rows = [[f"{r.shape.kv_heads} ({sharing(r.shape.heads, r.shape.kv_heads)})",
             _mib(r.kv_cache_mib), _fmt(r.layer.ms, 3) or _name(r.layer),
             _fmt(r.peer.ms, 3) or _name(r.peer), _speedup(r.vs_peer),
             _fmt(r.composed.ms, 3) or _name(r.composed)] for r in group]
    return Table(header, rows)


def kv_table(rows: list[KvRow]) -> Table:
    """Per shape with K and V in a reduced type: the fastest kernel, its read rate in the
    bytes it reads, against the fastest fp32 kernel and its own fp32 time, the quantization
    error, and the fastest peer in the same precision."""
    header = ["shape", "KV", "best kernel", "ms", "GB/s", "of bandwidth", "best fp32 kernel",
              "ms", "speedup over best fp32", "speedup over its own fp32", "max abs error",
              "RMS error / RMS output", "best peer", "speedup over peer"]
    out = []
    for r in rows:
        decode = r.shape.decode
        out.append([f"{r.shape.family} {replace(r.shape, kv='f32').label()}", r.shape.kv,
                    _name(r.kernel), _fmt(r.kernel.ms, 3), _fmt(r.gbps, 1) if decode else "",
                    _fmt(r.bw_frac, 3) if decode else "", _name(r.fp32), _fmt(r.fp32.ms, 3),
                    _speedup(r.vs_fp32), _speedup(r.own_vs_fp32),
                    "" if r.err_max is None else f"{r.err_max:.2g}",
                    "" if r.err_rms is None else f"{r.err_rms:.2g}",
                    _name(r.peer), _speedup(r.vs_peer)])
    return Table(header, out)


def variant_table(rows: list[VariantRow]) -> Table:
    """Per shape with an attention variant: the fastest kernel, its time over its own time
    without the variant, and the fastest peer that expresses the variant."""
    header = ["shape", "variant", "best kernel", "ms", "its ms without", "time over without",
              "best peer", "speedup over peer"]
    out = []
    for r in rows:
        plain = replace(r.shape, sinks=False, window=0, softcap=0.0, alibi=False)
        out.append([f"{r.shape.family} {plain.label()}", r.variant, _name(r.kernel),
                    _fmt(r.kernel.ms, 3), _fmt(r.plain.ms, 3), _fmt(r.vs_plain, 3),
                    _name(r.peer), _speedup(r.vs_peer)])
    return Table(header, out)


def change_table(changes: list[Change]) -> Table:
    rows = [[f"`{c.name}`", f"{c.old_ms:.3f}", f"{c.new_ms:.3f}", f"{c.ratio:.3f}",
             "" if c.pvalue is None else f"{c.pvalue:.4f}",
             f"**{c.verdict}**" if c.verdict == "regression" else c.verdict]
            for c in sorted(changes, key=lambda c: -c.ratio)]
    return Table(["benchmark", "old ms", "new ms", "new / old", "U-test p", "verdict"], rows)


def build(results: Results, out: Path, baseline: Results | None = None) -> Report:
    """Writes the plots into `out` and returns the report (also written by write())."""
    cpu = results.context.get("mha_cpu_model", "unknown CPU")
    report = Report(f"mha benchmark report: {cpu}")
    rounds = max((len(results.times(s, i)) for s in results.all_shapes()
                  for i in results.impls_of(s)), default=0)
    report.para(
        f"Commit `{results.context.get('mha_commit', '?')}`, size "
        f"`{results.context.get('mha_size', '?')}`, {rounds} round(s) per shape. Times are "
        "medians over rounds; a range [low, high] follows when there were several. Every "
        "speedup is a ratio of the two implementations' times in the same round (measured next "
        "to each other), its median and range over the rounds. Kernels are this project's; "
        "`composed-*` are baselines built from a BLAS sgemm; `peer-*` are framework operators "
        "timed on the same tensors in their own process.")
    report.heading("Machine")
    report.table(machine_table(results))

    errors = results.errors()
    if errors:
        report.heading("Errors")
        report.table(Table(["benchmark", "error"],
                           [[f"`{e.shape.name(e.impl)}`", e.error] for e in errors]))

    peers = peers_table(results)
    if peers is not None:
        report.heading("Peers")
        report.para(
            "Each peer runs in fp32 (the frameworks' f32 precision, no reduced-precision "
            "hints; on the reduced-KV shapes in the cache's type where its form reads it) "
            "with the benchmark's thread count as its intra-op threads and one "
            "inter-op thread, on the kernels' own input tensors. Its per-call overhead is its "
            "time per call on a trivial decode step (2 query heads, 16 keys of 16 floats, 1 "
            "thread); the summary shows it beside a best peer's time under a millisecond.")
        report.table(peers)

    attention = _has_attention(results)
    if attention:
        report.heading("Summary: the fastest kernel against the fastest peer")
        report.table(headline_table(headlines(results), peer_overheads(results)))
    variants = variant_rows(results)
    if variants:
        report.heading(VARIANTS_TITLE)
        report.para(
            "Shapes with an attention variant: a ragged batch (sequences of their own "
            "lengths), attention sinks, a sliding window, soft-capped logits (a cap c turns "
            "each logit s into c tanh(s / c)), ALiBi (head h adds -m_h |p - j| to the logit "
            "of key j in the row at position p among the keys, with the paper's slopes m_h = "
            "2^(-8 (h + 1) / H)). \"time over without\" is the fastest kernel's time over its "
            "own time on the same shape without the variant, round by round (a window's floor "
            "is its share of the query-key pairs: at L = 8192, causal, a window of 1024 keeps "
            "0.234 of them; for sinks, soft-capping and ALiBi the bar is 1.15x at most, the "
            "goal 1.05x). The peer is the fastest of those that can express the variant; the "
            "others are absent from these rows.")
        report.table(variant_table(variants))
    if any(s.kv != "f32" for s in results.shapes()):
        _kv_section(report, results)
    if results.cliff_shapes():
        _cliff_section(report, results, out)
    if results.gemm_shapes():
        _gemm_section(report, results)
    if results.layer_shapes():
        _layer_section(report, results, out)

    if attention:
        report.heading("Figures")
    figures = [
        (plots.prefill_vs_length, "prefill_vs_length.png", "prefill GFLOP/s against length"),
        (plots.decode_vs_length, "decode_vs_length.png", "decode GB/s against cache size"),
        (plots.decode_vs_kv_heads, "decode_vs_kv_heads.png", "decode time against Hkv"),
        (plots.heads_sweep, "heads_sweep.png", "time against heads at fixed width"),
        (plots.roofline, "roofline.png", "roofline"),
    ]
    for fn, name, alt in figures if attention else []:
        path = fn(results, out / name)
        if path is not None:
            report.image(path, alt)

    if baseline is not None:
        changes = compare(baseline, results)
        report.heading("Against the baseline run")
        flagged = [c for c in changes if c.verdict == "regression"]
        report.para(f"Baseline: commit `{baseline.context.get('mha_commit', '?')}` "
                    f"({baseline.source}). {len(flagged)} regression(s) of {len(changes)} "
                    "benchmarks in both runs: median time up by more than 5 % with the "
                    "Mann-Whitney U test (compare.py's) rejecting equal timings at p < 0.05.")
        path = plots.comparison(changes, out / "comparison.png", "baseline", "this run")
        if path is not None:
            report.image(path, "change per benchmark")
        report.table(change_table(changes))

    report.heading("Every shape")
    family = ""
    for shape in results.shapes():
        if shape.family != family:
            family = shape.family
            report.heading(family, 3)
        report.para(f"**{shape.label()}**")
        report.table(shape_table(shape_rows(results, shape), shape.decode))
    if results.gemm_shapes():
        report.heading("gemm", 3)
    for gemm in results.gemm_shapes():
        report.para(f"**{gemm.label()}**")
        report.table(shape_table(shape_rows(results, gemm), gemm.m <= 16, gemm_kind, False))
    if results.layer_shapes():
        report.heading("layer", 3)
    for layer in results.layer_shapes():
        cache = _mib(next((r.kv_cache_mib for r in layer_rows(results) if r.shape == layer),
                          None))
        report.para(f"**{layer.step} {layer.label()}**"
                    + (f" (KV cache {cache} MiB)" if cache else ""))
        report.table(shape_table(shape_rows(results, layer), layer.step == "decode",
                                 layer_kind, False))
    return report


def _has_attention(results: Results) -> bool:
    """Whether the report has an attention part: attention shapes, or nothing else (then the
    attention part's empty tables say so, as before the gemm and layer families)."""
    return bool(results.shapes()) or not (results.gemm_shapes() or results.layer_shapes()
                                          or results.cliff_shapes())


KV_TITLE = "Reduced-precision KV caches: K and V in f16, bf16 and i8"
VARIANTS_TITLE = ("Attention variants: ragged batches, sinks, sliding windows, soft-capping, "
                  "ALiBi")


def _kv_section(report: Report, results: Results) -> None:
    report.heading(KV_TITLE)
    report.para(
        "The same shapes with K and V stored in f16, bf16, or i8 with an fp32 scale per "
        "(token, KV head) row (mha/kv_types.h), read in place by the kernels that read the "
        "type (the others are absent from these rows, as is a peer without that form). GB/s "
        "counts the bytes actually read: the elements in their type and i8's scales. The "
        "speedups are over the fastest fp32 kernel of the same shape and over the same "
        "kernel's fp32 time, round by round. The errors are what the type costs on the "
        "benchmark's inputs (reference/sensitive.h: a few keys dominate each row, so a "
        "rounded key moves its logit visibly): the exact output on the stored values against "
        "the exact output on the fp32 values they were rounded from, over the rows the check "
        "reads; the kernels' own error against the stored values is the fp32 tolerance's."
        + _dram_note(results))
    report.table(kv_table(kv_rows(results)))


def _dram_note(results: Results) -> str:
    if results.context_float("probe_dram_gbps_1t"):
        return ""
    return (" This run's probe did not measure the DRAM bandwidth, so there are no "
            "bandwidth fractions.")


CLIFF_TITLE = "Cliffs: every tiled kernel over cache sizes, head widths and groups"


def cliff_table(summaries: list[cliffs.Summary]) -> Table:
    """Per kernel and phase: the median over the grid, the worst point, their ratio, the bar."""
    rows = []
    for s in summaries:
        w = s.worst
        rows.append([f"`{s.kernel}`", s.phase, str(len(s.points)), f"{s.median:.3f}",
                     w.shape.label().split(" ", 1)[1], f"{w.roof_frac:.3f}", f"{w.gflops:.1f}",
                     f"{s.ratio:.2f}", f"{s.bar:.1f}", "meets it" if s.passes else "**below**"])
    return Table(["kernel", "phase", "points", "median of roof", "worst point",
                  "its fraction of roof", "its GFLOP/s", "worst / median", "bar", "verdict"],
                 rows)


def _cliff_section(report: Report, results: Results, out: Path) -> None:
    report.heading(CLIFF_TITLE)
    native = results.context.get("cliffs_native_caches", "")
    report.para(
        "Every kernel that tiles for the caches, on 1 thread, with its tiling chosen for each "
        "cache configuration in turn: `native` is this CPU's own"
        + (f" (L1d, L2, L3 share: {native})" if native else "")
        + "; `<L1d>-<L2>` the tiling of another machine's caches (no L3 given, the most "
        "cautious), run on this CPU. Problems: one KV head and g query heads, prefill "
        "Lq = Lk = 512 (256 for g >= 8), decode one query row per head over 4 MiB of K and V "
        "(Lk = 2^19 / D). A point's figure is its fraction of the roof that binds (FMA peak, or "
        "the bandwidth of the level its K and V come from), the best of its rounds, which are "
        "spread over the sweep. A cliff is a point far below its kernel's median: the bar is "
        f"{cliffs.HAND_WRITTEN_BAR} of the median for hand-written kernels, "
        f"{cliffs.PORTABLE_BAR} for the portable ones (xsimd, Highway).")
    summaries = cliffs.summaries(results)
    report.table(cliff_table(summaries))
    for s in summaries:
        report.para(cliffs.worst_line(s))
    for kernel in cliffs.kernels(results):
        path = plots.cliff_heat_map(results, kernel, out / f"cliffs_{kernel}.png")
        if path is not None:
            report.image(path, f"cliff sweep of {kernel}")


def _gemm_section(report: Report, results: Results) -> None:
    report.heading(GEMM_TITLE)
    report.para(
        "C = A B with the weight B packed once (not timed): M tokens through a K x N weight. "
        "Kernels are this project's GEMM kernels (the fastest is named); the libraries are "
        "the sgemm of " + " and ".join(f"`{lib}`" for lib in GEMM_LIBRARIES) + "; the peer is "
        "`peer-torch-matmul` (torch.matmul in its own process). A speedup is the other's time "
        "over the kernel's, round by round. The DRAM bandwidth column (M <= 16 only): the "
        "weight read once per call, over the probe's DRAM read bandwidth; given when the "
        "weight does not fit in a cache." + _dram_note(results))
    report.table(gemm_table(gemm_rows(results)))


def _layer_section(report: Report, results: Results, out: Path) -> None:
    report.heading(LAYER_TITLE)
    attention = results.context.get("mha_best_kernel")
    report.para(
        "The layer is y = MultiHead(x): the Q, K and V projections, attention over the KV "
        "cache (appended to) and W^O. Prefill: n new tokens; decode: one token after a "
        "cache of Lk - 1 keys. The project's layer is named by its GEMM kernel"
        + (f" (its attention kernel: `{attention}`)" if attention else "")
        + "; `composed-*` are library sgemm with the composed attention (the faster is "
        "shown); the peer is `peer-torch-layer` (F.linear, scaled_dot_product_attention, "
        "F.linear). Of FMA peak is given for prefill; of DRAM bandwidth for decode: the four "
        "weights and the whole KV cache read once, over the probe's DRAM read bandwidth "
        "(1.0: a step as fast as reading them once at DRAM speed)." + _dram_note(results))
    rows = layer_rows(results)
    report.table(layer_table(rows))
    groups = kv_head_groups(results)
    if not groups:
        return
    report.heading("MHA vs GQA vs MQA (decode)", 3)
    report.para("The same decode step with fewer KV heads: query heads share them, so the "
                "cache (and K, V weights) shrink by H / Hkv and a step reads less. In the "
                "figure, whiskers span the rounds' range.")
    for group in groups:
        shape = group[0].shape
        report.para(f"**{shape.label(kv_heads=False)}**")
        report.table(kv_heads_table(group))
    path = plots.layer_decode_vs_kv_heads(results, out / "layer_decode_vs_kv_heads.png")
    if path is not None:
        report.image(path, "layer decode time against Hkv")


def write(report: Report, out: Path) -> tuple[Path, Path]:
    md, page = out / "report.md", out / "report.html"
    md.write_text(report.markdown(), encoding="utf-8")
    page.write_text(report.html(), encoding="utf-8")
    return md, page


def summary_text(results: Results) -> str:
    """The summary for the terminal: attention's headline table, then the GEMM and layer
    tables when the run has them."""
    parts = [headline_table(headlines(results)).text()] if _has_attention(results) else []
    if results.cliff_shapes():
        parts.append(f"{CLIFF_TITLE}\n"
                     + "\n".join(_plain(cliffs.worst_line(s)) for s in cliffs.summaries(results)))
    if results.gemm_shapes():
        parts.append(f"{GEMM_TITLE}\n{gemm_table(gemm_rows(results)).text()}")
    if results.layer_shapes():
        parts.append(f"{LAYER_TITLE}\n{layer_table(layer_rows(results)).text()}")
    return "\n\n".join(parts)


__all__ = ["build", "write", "summary_text", "Report", "Table", "Shape", "GemmShape",
           "LayerShape"]

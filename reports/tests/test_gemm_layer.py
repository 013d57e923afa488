"""The gemm/ and layer/ families: synthetic mha_bench results built here as small dicts (the
figures they must give are computed from the same numbers), and fixtures/quick-gemm-layer.json,
the gemm and layer benchmarks of a real `mha_bench --size=quick` run, for the name grammar
as mha_bench writes it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from mha_report import results as res
from mha_report import stats
from mha_report.__main__ import main
from mha_report.render import build, gemm_table, layer_table, summary_text, write

REAL = Path(__file__).parent / "fixtures" / "quick-gemm-layer.json"
QUICK = Path(__file__).parent / "fixtures" / "quick.json"

CONTEXT = {"mha_cpu_model": "Test CPU", "mha_commit": "abc1234", "mha_size": "test",
           "mha_best_kernel": "avx512", "probe_fma_gflops_1t": "4000.0",
           "probe_dram_gbps_1t": "10.0"}


def bench(name: str, ms: float, error: str = "", **counters: float) -> dict:
    """One iteration run as Google Benchmark writes it (peers: manual time)."""
    suffix = "/manual_time" if "/peer-" in name else "/real_time"
    b = {"name": name + suffix, "run_name": name + suffix, "run_type": "iteration",
         "repetitions": 1, "repetition_index": 0, "threads": 1, "iterations": 10,
         "real_time": ms, "cpu_time": ms, "time_unit": "ms", **counters}
    if error:
        b.update(error_occurred=True, error_message=error)
    return b


def gemm_name(impl: str, m: int, n: int = 1024, k: int = 1024, threads: int = 1) -> str:
    return f"gemm/{impl}/M:{m}/N:{n}/K:{k}/threads:{threads}"


def layer_name(impl: str, hkv: int, n: int, lk: int, threads: int = 1) -> str:
    return f"layer/{impl}/B:1/d:4096/H:32/Hkv:{hkv}/D:128/n:{n}/Lk:{lk}/causal:1/threads:{threads}"


def gemm_round(m: int, ms: dict[str, float], threads: int = 1) -> list[dict]:
    """One round of a GEMM shape; GFLOPS from the time (a peak of 4000), bw_frac for M <= 16
    as mha_bench gives it (the weight read once over 10 GB/s)."""
    flops, weight = 2.0 * m * 1024 * 1024, 4.0 * 1024 * 1024
    out = []
    for impl, t in ms.items():
        c = {"GFLOPS": flops / t / 1e6, "peak_frac": flops / t / 1e6 / 4000.0}
        if m <= 16:
            c.update(GBps=weight / t / 1e6, bw_frac=weight / t / 1e6 / 10.0)
        out.append(bench(gemm_name(impl, m, threads=threads), t, **c))
    return out


def layer_round(hkv: int, n: int, lk: int, ms: dict[str, float]) -> list[dict]:
    """One round of a layer shape: prefill counters, or decode's with bw_frac."""
    cache = 2.0 * hkv * lk * 128 * 4
    out = []
    for impl, t in ms.items():
        c = {"GFLOPS": 1e3 / t, "peak_frac": 10.0 / t, "kv_cache_bytes": cache}
        if n == 1:
            c.update(GBps=0.5 / t, bw_frac=0.05 / t)
        out.append(bench(layer_name(impl, hkv, n, lk), t, **c))
    return out


LAYER_IMPLS = ("avx512", "composed-openblas", "composed-onednn", "peer-torch-layer")
PEER_JITTER = (1.0, 1.5, 1.05)  # the peer's extra factor in rounds 1, 2, 3


def synthetic(rounds: int = 1) -> dict:
    """GEMM at M = 2048 and M = 1 with two kernels, two libraries and the peer; the layer's
    prefill (Hkv 8) and decode at Hkv 32, 8, 1, all `rounds` times (round k a little slower
    than round k - 1, the peer by PEER_JITTER besides: the median of the per-round ratios
    then differs from the ratio of the medians)."""
    benchmarks: list[dict] = []
    for m in (2048, 1):
        for r in range(rounds):
            f = 1.0 + 0.1 * r
            benchmarks += gemm_round(m, {"avx2": 4.0 * f, "avx512": 2.0 * f,
                                         "openblas": 3.0 * f, "onednn": 2.5 * f,
                                         "peer-torch-matmul": 5.0 * f * PEER_JITTER[r]})
    for hkv, n, lk in ((8, 2048, 2048), (32, 1, 8192), (8, 1, 8192), (1, 1, 8192)):
        base = 100.0 if n > 1 else 2.0 * (1 + hkv / 8)
        for r in range(rounds):
            f = 1.0 + 0.1 * r
            times = (base * f, 3 * base * f, 1.5 * base * f, 2 * base * f * PEER_JITTER[r])
            benchmarks += layer_round(hkv, n, lk, dict(zip(LAYER_IMPLS, times)))
    return {"context": dict(CONTEXT), "benchmarks": benchmarks}


def test_the_gemm_and_layer_names() -> None:
    shape, impl = res.parse_name("gemm/peer-torch-matmul/M:1/N:4096/K:1024/threads:2/"
                                 "manual_time")
    assert impl == "peer-torch-matmul"
    assert shape == res.GemmShape(m=1, n=4096, k=1024, threads=2)
    assert shape.family == "gemm" and shape.label() == "M=1 N=4096 K=1024, 2 threads"
    assert shape.name("avx2") == "gemm/avx2/M:1/N:4096/K:1024/threads:2"
    shape, impl = res.parse_name("layer/composed-onednn/B:1/d:4096/H:32/Hkv:8/D:128/n:1/"
                                 "Lk:8192/causal:1/threads:1/real_time")
    assert impl == "composed-onednn"
    assert shape == res.LayerShape(batch=1, d=4096, heads=32, kv_heads=8, dim=128,
                                   new_tokens=1, kv_len=8192, causal=True, threads=1)
    assert shape.step == "decode" and shape.label() == "d=4096 H=32 Hkv=8 D=128 Lk=8192, 1 thread"
    assert shape.name("x") == ("layer/x/B:1/d:4096/H:32/Hkv:8/D:128/n:1/Lk:8192/causal:1/"
                               "threads:1")
    prefill, _ = res.parse_name("layer/avx512/B:2/d:256/H:4/Hkv:2/D:64/n:64/Lk:64/causal:0/"
                                "threads:1")
    assert prefill.step == "prefill"
    assert prefill.label() == "B=2 d=256 H=4 Hkv=2 D=64 n=64, 1 thread"
    assert res.parse_name("gemm/avx2/M:1/N:2/threads:1") is None
    assert res.parse_name("layer/avx2/B:1/d:256/H:4/Hkv:2/D:64/n:1/causal:1/threads:1") is None
    # The attention grammar is unchanged and does not take the new families.
    assert res.NAME.match(gemm_name("avx2", 1)) is None
    assert isinstance(res.parse_name("decode/avx2/B:1/H:4/Hkv:2/Lq:1/Lk:8/D:64/causal:1/"
                                     "threads:1")[0], res.Shape)
    assert res.is_own(res.GemmShape(1, 2, 3, 1), "avx512")
    assert not res.is_own(res.GemmShape(1, 2, 3, 1), "onednn")
    assert not res.is_own(res.GemmShape(1, 2, 3, 1), "peer-torch-matmul")
    assert not res.is_own(prefill, "composed-openblas") and res.is_own(prefill, "avx512")


def test_a_real_run_parses() -> None:
    raw = json.loads(REAL.read_text())
    run = res.parse(raw, str(REAL))
    assert len(run.runs) == len(raw["benchmarks"]) > 0
    assert {r.shape.name(r.impl) for r in run.runs} == {
        b["name"].replace("/real_time", "").replace("/manual_time", "")
        for b in raw["benchmarks"]}
    assert run.gemm_shapes() and run.layer_shapes() and not run.shapes()
    assert {r.shape.step for r in stats.layer_rows(run)} == {"prefill", "decode"}
    for row in stats.gemm_rows(run):
        assert res.is_own(row.shape, row.kernel.impl) and res.is_library(row.library.impl)
        assert row.peer.impl == "peer-torch-matmul"
    for row in stats.layer_rows(run):
        assert row.layer.impl == run.context["mha_best_kernel"]
        assert row.composed.impl.startswith("composed-") and row.kv_cache_mib > 0


def test_gemm_rows_name_the_best_kernel_and_library() -> None:
    run = res.parse(synthetic())
    rows = {r.shape.m: r for r in stats.gemm_rows(run)}
    assert [r.shape.m for r in stats.gemm_rows(run)] == [1, 2048]
    big, small = rows[2048], rows[1]
    assert big.kernel.impl == "avx512" and big.kernel.ms.median == pytest.approx(2.0)
    assert big.library.impl == "onednn" and big.peer.impl == "peer-torch-matmul"
    assert big.vs_library.median == pytest.approx(2.5 / 2.0)
    assert big.vs_peer.median == pytest.approx(5.0 / 2.0)
    assert big.gflops.median == pytest.approx(2.0 * 2048 * 1024 * 1024 / 2.0 / 1e6)
    assert big.library_gflops.median == pytest.approx(2.0 * 2048 * 1024 * 1024 / 2.5 / 1e6)
    assert big.peak_frac.median == pytest.approx(big.gflops.median / 4000.0)
    assert big.bw_frac is None
    assert small.bw_frac.median == pytest.approx(4.0 * 1024 * 1024 / 2.0 / 1e6 / 10.0)

    table = gemm_table(stats.gemm_rows(run))
    col = {h: i for i, h in reversed(list(enumerate(table.header)))}  # first of equal names
    by_m = {row[0].split()[0]: row for row in table.rows}
    assert by_m["M=2048"][col["best kernel"]] == "`avx512`"
    assert by_m["M=2048"][col["best library"]] == "`onednn`"
    assert by_m["M=2048"][col["speedup over library"]] == "**1.25x**"
    assert by_m["M=2048"][col["peer"]] == "`peer-torch-matmul`"
    assert by_m["M=2048"][col["speedup over peer"]] == "**2.50x**"
    assert by_m["M=2048"][col["of DRAM bandwidth"]] == ""  # M > 16: the weight is not the limit
    assert by_m["M=1"][col["of DRAM bandwidth"]] == f"{small.bw_frac.median:.3f}"


def test_layer_rows_prefill_and_decode() -> None:
    run = res.parse(synthetic())
    rows = stats.layer_rows(run)
    assert [(r.shape.step, r.shape.kv_heads) for r in rows] == [
        ("prefill", 8), ("decode", 32), ("decode", 8), ("decode", 1)]
    prefill, decode = rows[0], rows[2]
    for r, base in ((prefill, 100.0), (decode, 4.0)):
        assert r.layer.impl == "avx512" and r.layer.ms.median == pytest.approx(base)
        assert r.peer.impl == "peer-torch-layer" and r.peer.ms.median == pytest.approx(2 * base)
        assert r.composed.impl == "composed-onednn"
        assert r.composed.ms.median == pytest.approx(1.5 * base)
        assert r.vs_peer.median == pytest.approx(2.0)
        assert r.vs_composed.median == pytest.approx(1.5)
        assert r.kv_cache_mib == pytest.approx(2.0 * 8 * r.shape.kv_len * 128 * 4 / 2**20)
    assert decode.bw_frac.median == pytest.approx(0.05 / 4.0)
    assert prefill.bw_frac is None and prefill.peak_frac.median == pytest.approx(0.1)

    table = layer_table(rows)
    col = {h: i for i, h in reversed(list(enumerate(table.header)))}
    first, third = table.rows[0], table.rows[2]
    assert first[col["step"]] == "prefill" and "n=2048 causal" in first[col["shape"]]
    assert first[col["of FMA peak"]] == "0.100" and first[col["of DRAM bandwidth"]] == ""
    assert third[col["step"]] == "decode" and "Lk=8192" in third[col["shape"]]
    assert third[col["of FMA peak"]] == ""
    assert third[col["of DRAM bandwidth"]] == f"{0.05 / 4.0:.3f}"
    assert third[col["KV cache MiB"]] == "64"
    assert third[col["speedup over peer"]] == "**2.00x**"
    assert third[col["best composed"]] == "`composed-onednn`"


def test_mha_gqa_mqa_groups_decode_shapes_by_kv_heads(tmp_path: Path) -> None:
    run = res.parse(synthetic())
    groups = stats.kv_head_groups(run)
    assert len(groups) == 1  # the prefill shape has no partner at another Hkv
    assert [r.shape.kv_heads for r in groups[0]] == [32, 8, 1]
    assert [r.kv_cache_mib for r in groups[0]] == [256, 64, 8]
    md, _ = write(build(run, tmp_path), tmp_path)
    text = md.read_text()
    section = text[text.index("### MHA vs GQA vs MQA (decode)"):]
    assert "**d=4096 H=32 D=128 Lk=8192, 1 thread**" in section
    assert "| Hkv | KV cache MiB | `avx512` ms | `peer-torch-layer` ms |" in section
    assert "| 32 (MHA) | 256 | 10.000 | 20.000 | **2.00x** | 15.000 |" in section
    assert "| 8 (GQA g=4) | 64 | 4.000 |" in section
    assert "| 1 (MQA) | 8 | 2.250 |" in section
    assert "](layer_decode_vs_kv_heads.png)" in section
    assert (tmp_path / "layer_decode_vs_kv_heads.png").read_bytes()[:4] == b"\x89PNG"


def test_a_reduced_cache_is_a_layer_shape_of_its_own(tmp_path: Path) -> None:
    name = "layer/avx512/B:1/d:4096/H:32/Hkv:8/D:128/n:1/Lk:8192/causal:1/kv:i8/threads:2"
    shape, impl = res.parse_name(name + "/real_time")
    assert impl == "avx512" and shape.kv == "i8" and shape.step == "decode"
    assert shape.name("avx512") == name
    assert shape.label() == "d=4096 H=32 Hkv=8 D=128 Lk=8192 KV i8, 2 threads"
    fp32, _ = res.parse_name(name.replace("/kv:i8", ""))
    assert fp32.kv == "f32" and fp32 != shape
    assert res.parse_name(name.replace("kv:i8", "kv:f64")) is None
    # Decode rows at another Hkv group with the fp32 rows only: the i8 row (the project's
    # layer alone, no peer keeps an i8 cache) stays out of their MHA/GQA/MQA group.
    data = synthetic()
    data["benchmarks"].append(bench(layer_name("avx512", 8, 1, 8192).replace(
        "/threads:", "/kv:i8/threads:"), 1.5, GFLOPS=1.0, peak_frac=0.01))
    run = res.parse(data)
    groups = stats.kv_head_groups(run)
    assert len(groups) == 1 and all(r.shape.kv == "f32" for r in groups[0])
    rows = [r for r in stats.layer_rows(run) if r.shape.kv == "i8"]
    assert len(rows) == 1 and rows[0].layer.ms.median == pytest.approx(1.5)
    assert rows[0].vs_peer is None


def test_rounds_give_medians_ranges_and_paired_ratios() -> None:
    run = res.parse(synthetic(rounds=3))
    shape = res.GemmShape(2048, 1024, 1024, 1)
    assert [r.round for r in run.runs if r.shape == shape and r.impl == "avx512"] == [0, 1, 2]
    row = next(r for r in stats.gemm_rows(run) if r.shape == shape)
    assert (row.kernel.ms.median, row.kernel.ms.low, row.kernel.ms.high, row.kernel.ms.n) == (
        pytest.approx(2.2), pytest.approx(2.0), pytest.approx(2.4), 3)
    # Round by round: the peer's k-th time over the kernel's k-th, not a ratio of medians.
    ratios = [2.5 * j for j in PEER_JITTER]
    assert row.vs_peer.median == pytest.approx(statistics.median(ratios))
    medians = statistics.median(run.times(shape, "peer-torch-matmul")) / statistics.median(
        run.times(shape, "avx512"))
    assert abs(row.vs_peer.median - medians) > 0.1
    assert (row.vs_peer.low, row.vs_peer.high) == (pytest.approx(2.5), pytest.approx(3.75))
    assert row.vs_library.text() == "1.25 [1.25, 1.25]"
    table = gemm_table([row])
    assert "2.200 [2.000, 2.400]" in table.rows[0]
    assert f"**{row.vs_peer.median:.2f} [2.50, 3.75]x**" in table.rows[0]
    layer = stats.layer_rows(run)[0]
    assert layer.layer.ms.text(3) == "110.000 [100.000, 120.000]"
    assert layer.vs_peer.text() == "2.10 [2.00, 3.00]"


def test_the_report_says_three_rounds(tmp_path: Path) -> None:
    md, _ = write(build(res.parse(synthetic(rounds=3)), tmp_path), tmp_path)
    assert "3 round(s) per shape" in md.read_text()


def test_an_error_is_reported_and_its_round_left_out(tmp_path: Path) -> None:
    data = synthetic(rounds=3)
    broken = gemm_name("avx512", 2048)
    second = [b for b in data["benchmarks"] if b["name"].startswith(broken + "/")][1]
    second.update(error_occurred=True, error_message="output differs from the reference")
    # A layer shape whose project layer fails in every round.
    failing = layer_name("avx512", 8, 2048, 2048)
    for b in data["benchmarks"]:
        if b["name"].startswith(failing + "/"):
            b.update(error_occurred=True, error_message="avx512: out of memory")
    run = res.parse(data)
    shape = res.GemmShape(2048, 1024, 1024, 1)
    assert run.round_times(shape, "avx512").keys() == {0, 2}
    assert stats.paired_ratios(run, shape, "onednn", "avx512") == pytest.approx([1.25, 1.25])
    row = next(r for r in stats.gemm_rows(run) if r.shape == shape)
    assert row.kernel.ms.n == 2 and row.vs_peer.n == 2
    assert row.vs_peer.high == pytest.approx(2.5 * PEER_JITTER[2])  # round 2 left out

    prefill = stats.layer_rows(run)[0]
    assert prefill.layer.impl is None and prefill.layer.failed and prefill.vs_peer is None
    assert layer_table([prefill]).rows[0][2] == "error"

    md, page = write(build(run, tmp_path), tmp_path)
    text = md.read_text()
    errors = text[text.index("## Errors"):text.index("## GEMM")]
    assert f"| `{broken}` | output differs from the reference |" in errors
    assert errors.count(f"`{failing}`") == 3
    assert "avx512: out of memory" in page.read_text()


def test_report_sections_and_summary(tmp_path: Path) -> None:
    run = res.parse(synthetic())
    md, page = write(build(run, tmp_path), tmp_path)
    text = md.read_text()
    heads = [line for line in text.splitlines() if line.startswith("#")]
    assert heads == [
        "# mha benchmark report: Test CPU", "## Machine",
        "## GEMM: the fastest kernel against the fastest library and peer",
        "## Layer: the project's attention layer against PyTorch and the composed baselines",
        "### MHA vs GQA vs MQA (decode)", "## Every shape", "### gemm", "### layer"]
    assert "(its attention kernel: `avx512`)" in text
    assert "did not measure the DRAM bandwidth" not in text
    assert "| `onednn` (library) |" in text and "| `avx512` (kernel) |" in text
    assert "| `composed-onednn` (baseline) |" in text and "| `avx512` (layer) |" in text
    assert "**decode d=4096 H=32 Hkv=8 D=128 Lk=8192, 1 thread** (KV cache 64 MiB)" in text
    body = page.read_text()
    assert "<h2>GEMM: the fastest kernel" in body and "<code>onednn</code>" in body
    assert body.count("data:image/png;base64,") == 1

    summary = summary_text(run)
    assert "GEMM: the fastest kernel against the fastest library and peer" in summary
    assert "Layer: the project's attention layer against PyTorch and the composed" in summary
    assert "best peer" not in summary  # no attention shapes: no attention table
    assert len(summary.splitlines()) == (1 + 1 + 2) + 1 + (1 + 1 + 4)


def test_attention_with_gemm_and_layer(tmp_path: Path) -> None:
    quick = json.loads(QUICK.read_text())
    alone = res.parse(quick)
    data = dict(quick, benchmarks=quick["benchmarks"] + synthetic()["benchmarks"])
    both = res.parse(data)
    assert both.shapes() == alone.shapes()
    assert stats.headlines(both) == stats.headlines(alone)
    assert summary_text(both).startswith(summary_text(alone) + "\n\nGEMM: ")
    text = write(build(both, tmp_path), tmp_path)[0].read_text()
    order = [text.index(h) for h in (
        "## Summary: the fastest kernel against the fastest peer", "## GEMM", "## Layer",
        "## Figures", "## Every shape", "### prefill", "### gemm", "### layer")]
    assert order == sorted(order)
    (tmp_path / "a").mkdir()
    attention_only = write(build(alone, tmp_path / "a"), tmp_path / "a")[0].read_text()
    assert "## GEMM" not in attention_only and "### layer" not in attention_only


def test_command_line_with_only_gemm_and_layer(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(REAL), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "GEMM: the fastest kernel" in out and "peer-torch-layer" in out
    text = (tmp_path / "r" / "report.md").read_text()
    assert "did not measure the DRAM bandwidth" in text  # this run's probe: DRAM 0

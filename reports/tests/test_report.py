"""The report generator on committed mha_bench results: fixtures/quick.json is a real
`mha_bench --size=quick --rounds=5 --peers=...` run (kernels, composed baselines and the four
framework peers; its CPU is in its context). The expected figures are recomputed here from
the JSON itself, never typed in."""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from mha_report import plots
from mha_report import results as res
from mha_report import stats
from mha_report.__main__ import main
from mha_report.render import build, summary_text, write
from mha_report.stats import headlines

FIXTURE = Path(__file__).parent / "fixtures" / "quick.json"


@pytest.fixture(scope="module")
def raw() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def run(raw: dict) -> res.Results:
    return res.parse(raw, str(FIXTURE))


def iterations(raw: dict) -> list[dict]:
    return [b for b in raw["benchmarks"] if b.get("run_type", "iteration") == "iteration"]


def test_every_run_is_parsed_with_its_shape(raw: dict, run: res.Results) -> None:
    assert len(run.runs) == len(iterations(raw))
    names = {b["name"] for b in iterations(raw)}
    assert {r.shape.name(r.impl) for r in run.runs} == {
        n.replace("/real_time", "").replace("/manual_time", "") for n in names}
    impls = run.impls()
    assert {"naive", "blocked"} <= set(impls)
    assert any(res.is_peer(i) for i in impls), "the fixture must hold peers"
    decode = [r for r in run.runs if r.shape.family == "decode"]
    assert decode and all("GBps" in r.counters for r in decode if not r.error)


def test_the_name_grammar() -> None:
    m = res.NAME.match("decode/peer-ort-gqa/B:1/H:32/Hkv:8/Lq:1/Lk:32768/D:128/causal:1/"
                       "threads:2/manual_time")
    assert m and m["impl"] == "peer-ort-gqa" and m["kv_len"] == "32768" and m["threads"] == "2"
    assert res.NAME.match("prefill/avx2/B:1/H:32/Hkv:8/Lq:2048/Lk:2048/D:128/causal:0/threads:1")
    assert res.NAME.match("BM_something/8") is None
    shape, impl = res.parse_name("decode/avx512/B:1/H:32/Hkv:8/Lq:1/Lk:32768/D:128/causal:1/"
                                 "sinks:1/window:4096/threads:2/real_time")
    assert impl == "avx512" and shape.sinks and shape.window == 4096 and shape.threads == 2
    assert shape.name("x").endswith("/causal:1/sinks:1/window:4096/threads:2")
    assert "window 4096" in shape.label() and shape.kv_bytes() == 2 * 8 * 4096 * 128 * 4
    # A soft-cap is a float as C++ streams it (%g), and its name comes back the same.
    prefill = "prefill/avx2/B:1/H:32/Hkv:8/Lq:2048/Lk:2048/D:128/causal:1"
    for text, cap in (("20", 20.0), ("0.5", 0.5), ("1e-05", 1e-5), ("1.5e+07", 1.5e7)):
        name = f"{prefill}/softcap:{text}/threads:1"
        shape, impl = res.parse_name(name + "/real_time")
        assert impl == "avx2" and shape.softcap == cap and shape.name(impl) == name
        assert f" softcap {text}," in shape.label()
    shape, _ = res.parse_name(f"{prefill}/window:64/softcap:20/threads:2")
    assert shape.window == 64 and shape.softcap == 20.0 and shape.threads == 2
    assert res.parse_name(f"{prefill}/softcap:/threads:1") is None
    assert res.parse_name(f"{prefill}/softcap:20/window:64/threads:1") is None  # out of order
    # ALiBi: "/alibi:1" after every other variant, before the threads.
    name = f"{prefill}/alibi:1/threads:1"
    shape, impl = res.parse_name(name + "/real_time")
    assert impl == "avx2" and shape.alibi and shape.name(impl) == name
    assert " ALiBi," in shape.label()
    assert not res.parse_name(f"{prefill}/threads:1")[0].alibi
    name = f"{prefill}/sinks:1/window:64/softcap:20/alibi:1/threads:2"
    shape, _ = res.parse_name(name + "/manual_time")
    assert shape.sinks and shape.window == 64 and shape.softcap == 20.0 and shape.alibi
    assert shape.name("avx2") == name and shape.threads == 2
    assert res.parse_name(f"{prefill}/alibi:1/softcap:20/threads:1") is None  # out of order
    assert res.parse_name(f"{prefill}/alibi:1/window:64/threads:1") is None
    assert res.parse_name(f"{prefill}/alibi:0/threads:1") is None


def test_aggregates_are_skipped_and_errors_kept(raw: dict) -> None:
    data = copy.deepcopy(raw)
    first = iterations(data)[0]
    agg = dict(first, name=first["name"] + "_median", run_type="aggregate")
    broken = dict(first, error_occurred=True, error_message="output differs")
    data["benchmarks"] += [agg, broken]
    r = res.parse(data)
    assert len(r.runs) == len(iterations(raw)) + 1
    assert [e.error for e in r.errors()] == ["output differs"]
    assert len(r.times(r.runs[0].shape, r.runs[0].impl)) == len(
        res.parse(raw).times(r.runs[0].shape, r.runs[0].impl))  # the error is not a time


def test_rounds_pair_up_in_order(raw: dict, run: res.Results) -> None:
    shape = run.shapes()[0]
    peer = next(i for i in run.impls() if res.is_peer(i) and run.times(shape, i))
    def seconds(impl: str) -> list[float]:
        return [b["real_time"] * {"ms": 1e-3, "us": 1e-6, "ns": 1e-9}[b["time_unit"]]
                for b in iterations(raw) if b["name"].startswith(shape.name(impl) + "/")]
    want = [p / k for p, k in zip(seconds(peer), seconds("blocked"))]
    assert len(want) >= 5
    assert stats.paired_ratios(run, shape, peer, "blocked") == pytest.approx(want)


def test_headline_is_fastest_kernel_over_fastest_peer(run: res.Results) -> None:
    for h in stats.headlines(run):
        impls = [i for i in run.impls() if run.times(h.shape, i)]
        medians = {i: statistics.median(run.times(h.shape, i)) for i in impls}
        assert h.kernel == min((i for i in impls if res.is_kernel(i)), key=medians.get)
        peers = [i for i in impls if res.is_peer(i)]
        assert h.peer == min(peers, key=medians.get)
        ratios = [p / k for p, k in zip(run.times(h.shape, h.peer), run.times(h.shape, h.kernel))]
        assert h.speedup.median == pytest.approx(statistics.median(ratios))
        assert h.speedup.low == pytest.approx(min(ratios))


def test_shape_rows_speedups(run: res.Results) -> None:
    shape = run.shapes()[0]
    rows = stats.shape_rows(run, shape)
    assert [r.ms.median for r in rows] == sorted(r.ms.median for r in rows)
    naive = next(r for r in rows if r.impl == "naive")
    assert naive.vs_naive.median == pytest.approx(1.0)


def slowed(raw: dict, name: str, factor: float) -> dict:
    data = copy.deepcopy(raw)
    for b in iterations(data):
        if b["name"] == name:
            b["real_time"] *= factor
            b["cpu_time"] *= factor
    return data


def test_comparison_flags_a_regression_and_only_it(raw: dict) -> None:
    name = next(b["name"] for b in iterations(raw) if "/blocked/" in b["name"])
    old, new = res.parse(raw, "old"), res.parse(slowed(raw, name, 1.5), "new")
    changes = {c.name: c for c in stats.compare(old, new)}
    assert changes[name].verdict == "regression"
    assert changes[name].ratio == pytest.approx(1.5)
    assert changes[name].pvalue < 0.05
    others = [c for n, c in changes.items() if n != name]
    assert others and all(c.verdict == "same" for c in others)
    faster = {c.name: c for c in stats.compare(old, res.parse(slowed(raw, name, 0.5)))}
    assert faster[name].verdict == "improvement"


def test_one_repetition_is_untested(raw: dict) -> None:
    data = copy.deepcopy(raw)
    seen: set[str] = set()
    data["benchmarks"] = [b for b in iterations(data)
                          if not (b["name"] in seen or seen.add(b["name"]))]
    changes = stats.compare(res.parse(data), res.parse(data))
    assert changes and all(c.verdict == "untested" for c in changes)


def test_report_files(run: res.Results, tmp_path: Path) -> None:
    baseline = res.parse(slowed(run.raw, iterations(run.raw)[0]["name"], 1.5), "baseline")
    md, page = write(build(run, tmp_path, baseline), tmp_path)
    text = md.read_text()
    assert run.context["mha_cpu_model"] in text
    assert "Summary: the fastest kernel against the fastest peer" in text
    assert "improvement" in text  # the baseline was slower in one benchmark
    images = sorted(p.name for p in tmp_path.glob("*.png"))
    assert {"roofline.png", "comparison.png"} <= set(images)
    for image in images:
        assert (tmp_path / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({image})" in text
    body = page.read_text()
    assert body.count("data:image/png;base64,") == len(images)
    assert ".png" not in body.replace("data:image/png", "")  # self-contained


def test_peers_table_and_overheads(raw: dict, tmp_path: Path) -> None:
    """The peers' table comes from the context (version, how, per-call overhead), and a best
    peer's time under a millisecond carries its overhead in the summary."""
    data = copy.deepcopy(raw)
    run = res.parse(data, "peers")
    fast = [h for h in headlines(run) if h.peer and h.peer_ms < 1.0]
    assert fast, "the quick fixture has shapes under a millisecond"
    peer = fast[0].peer
    data["context"][f"{peer}_how"] = "a form that says how"
    data["context"][f"{peer}_overhead_us"] = "123.4"
    run = res.parse(data, "peers")
    md, _ = write(build(run, tmp_path), tmp_path)
    text = md.read_text()
    assert "## Peers" in text
    assert f"| `{peer}` | {data['context'][peer + '_version']} | a form that says how | 123.4 |" \
        in text
    assert f"{fast[0].peer_ms:.3f} (overhead 0.123)" in text


def test_summary_lists_every_shape_with_a_kernel(run: res.Results) -> None:
    lines = summary_text(run).splitlines()
    assert len(lines) == 1 + len(stats.headlines(run))


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(FIXTURE), "--out", str(tmp_path / "r")]) == 0
    assert "best peer" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.html").exists()
    missing = tmp_path / "none.json"
    assert main([str(missing), "--out", str(tmp_path / "x")]) == 2
    empty = tmp_path / "empty.json"
    empty.write_text('{"context": {}, "benchmarks": []}')
    assert main([str(empty), "--out", str(tmp_path / "x")]) == 2


def with_variant(raw: dict, keep: Callable[[res.Shape, str], bool], tag: str, factor: float,
                 **counters: float) -> dict:
    """The fixture plus, for every run that `keep` picks (by shape and implementation), the
    same run with `tag` ("/kv:f16", "/window:64", "/softcap:20", "/alibi:1") before
    "/threads:" in its name, taking `factor` of its time, with `counters` added."""
    data = copy.deepcopy(raw)
    extra = []
    for b in iterations(data):
        parsed = res.parse_name(b["name"])
        if parsed is None or not isinstance(parsed[0], res.Shape) or b.get("error_occurred"):
            continue
        if keep(*parsed):
            extra.append(dict(b, name=b["name"].replace("/threads:", f"{tag}/threads:"),
                              real_time=b["real_time"] * factor, **counters))
    data["benchmarks"] += extra
    return data


def with_kv_f16(raw: dict, factor: float) -> dict:
    """Every kernel's decode run again with K and V in f16, with quantization-error counters."""
    return with_variant(raw, lambda shape, impl: shape.family == "decode" and res.is_kernel(impl),
                        "/kv:f16", factor, kv_err_max=1e-3, kv_err_rms=2e-4)


def test_kv_type_in_names_and_rows(raw: dict, tmp_path: Path) -> None:
    m = res.NAME.match("decode/avx2/B:1/H:32/Hkv:8/Lq:1/Lk:4096/D:128/causal:1/kv:i8/threads:1"
                       "/real_time")
    assert m and m["kv"] == "i8" and m["threads"] == "1"
    assert res.NAME.match("decode/avx2/B:1/H:32/Hkv:8/Lq:1/Lk:4096/D:128/causal:1/kv:f64/"
                          "threads:1") is None
    shape, _ = res.parse_name("decode/avx2/B:1/H:32/Hkv:8/Lq:1/Lk:4096/D:128/causal:1/kv:i8/"
                              "threads:1")
    assert shape.kv == "i8" and shape.name("x").endswith("/causal:1/kv:i8/threads:1")
    assert shape.kv_bytes() == 2 * 8 * 4096 * (128 + 4)
    run = res.parse(with_kv_f16(raw, 0.5))
    rows = stats.kv_rows(run)
    assert rows and all(r.shape.kv == "f16" for r in rows)
    for r in rows:
        fp32 = replace(r.shape, kv="f32")
        assert r.fp32.impl == stats.fastest(run, fp32, [i for i in run.impls_of(fp32)
                                                       if res.is_kernel(i)])
        assert r.own_vs_fp32.median == pytest.approx(2.0)
        assert r.err_max == pytest.approx(1e-3) and r.err_rms == pytest.approx(2e-4)
    # The reduced shapes stay out of the fp32 sweeps and have their own section.
    report = build(run, tmp_path)
    text = report.markdown()
    assert "## Reduced-precision KV caches" in text
    assert text.count("| f16 |") == len(rows)
    assert "Reduced-precision" not in build(res.parse(raw), tmp_path).markdown()


def with_window(raw: dict, factor: float) -> dict:
    """Every run of a plain causal prefill shape again with a sliding window of 64 keys; of
    the peers only peer-ort-gqa (as a peer that cannot express the window is absent)."""
    def keep(shape: res.Shape, impl: str) -> bool:
        return (shape.family == "prefill" and shape.causal and not shape.sinks
                and shape.kv == "f32" and (not res.is_peer(impl) or impl == "peer-ort-gqa"))
    return with_variant(raw, keep, "/window:64", factor)


def test_variant_rows_pair_each_variant_with_its_plain_twin(raw: dict, tmp_path: Path) -> None:
    run = res.parse(with_window(raw, 0.25))
    rows = stats.variant_rows(run)
    windowed = [r for r in rows if r.shape.window == 64]
    assert windowed and all(r.variant == "window 64" for r in windowed)
    for r in windowed:
        plain = replace(r.shape, window=0)
        assert r.kernel.impl == stats.fastest(run, r.shape, [i for i in run.impls_of(r.shape)
                                                              if res.is_kernel(i)])
        assert r.plain.impl == r.kernel.impl and r.vs_plain is not None
        assert r.vs_plain.median == pytest.approx(0.25)
        assert r.plain.ms is not None and r.plain.ms.median == pytest.approx(
            statistics.median(run.times(plain, r.kernel.impl)) * 1e3)
        assert r.peer.impl in (None, "peer-ort-gqa")
    # A ragged batch (if the fixture has one) has no plain twin.
    assert all(r.plain.impl is None for r in rows if r.shape.family == "ragged")
    text = build(run, tmp_path).markdown()
    assert "Attention variants" in text and "window 64" in text


def with_softcap(raw: dict, factor: float) -> dict:
    """Every run of a plain causal prefill shape again with its logits soft-capped at 20; of
    the peers only the ONNX Runtime ones (PyTorch's and OpenVINO's cannot express the cap)."""
    def keep(shape: res.Shape, impl: str) -> bool:
        return (shape.family == "prefill" and shape.causal and shape.kv == "f32"
                and (not res.is_peer(impl) or impl in ("peer-ort-gqa", "peer-ort-attention")))
    return with_variant(raw, keep, "/softcap:20", factor)


def test_softcap_rows_pair_with_their_plain_twin(raw: dict, tmp_path: Path) -> None:
    data = with_softcap(raw, 1.1)
    capped = [b["name"] for b in iterations(data) if "/softcap:" in b["name"]]
    assert capped
    for name in capped:
        shape, impl = res.parse_name(name)
        assert shape.softcap == 20.0
        assert shape.name(impl) == name.replace("/real_time", "").replace("/manual_time", "")
    run = res.parse(data)
    rows = [r for r in stats.variant_rows(run) if r.shape.softcap]
    assert rows and all(r.variant == "softcap 20" for r in rows)
    for r in rows:
        plain = replace(r.shape, softcap=0.0)
        assert r.plain.impl == r.kernel.impl and r.vs_plain is not None
        assert r.vs_plain.median == pytest.approx(1.1)
        assert r.plain.ms.median == pytest.approx(
            statistics.median(run.times(plain, r.kernel.impl)) * 1e3)
        assert r.peer.impl in ("peer-ort-gqa", "peer-ort-attention")
    text = build(run, tmp_path).markdown()
    assert "Attention variants" in text and "soft-capping" in text
    for r in rows:
        plain = replace(r.shape, softcap=0.0)
        assert (f"| {r.shape.family} {plain.label()} | softcap 20 | `{r.kernel.impl}` | "
                f"{r.kernel.ms.text(3)} | {r.plain.ms.text(3)} | {r.vs_plain.text(3)} |") in text


def with_alibi(raw: dict, factor: float) -> dict:
    """Every run of a plain causal prefill shape again with ALiBi; the peers too (each can
    express it in prefill)."""
    def keep(shape: res.Shape, impl: str) -> bool:
        return (shape.family == "prefill" and shape.causal and shape.kv == "f32"
                and not shape.sinks and not shape.window and not shape.softcap)
    return with_variant(raw, keep, "/alibi:1", factor)


def test_alibi_rows_pair_with_their_plain_twin(raw: dict, tmp_path: Path) -> None:
    data = with_alibi(raw, 1.2)
    biased = [b["name"] for b in iterations(data) if "/alibi:1" in b["name"]]
    assert biased
    for name in biased:
        shape, impl = res.parse_name(name)
        assert shape.alibi
        assert shape.name(impl) == name.replace("/real_time", "").replace("/manual_time", "")
    run = res.parse(data)
    rows = [r for r in stats.variant_rows(run) if r.shape.alibi]
    assert rows and all(r.variant == "ALiBi" for r in rows)
    for r in rows:
        plain = replace(r.shape, alibi=False)
        assert r.plain.impl == r.kernel.impl and r.vs_plain is not None
        assert r.vs_plain.median == pytest.approx(1.2)
        assert r.plain.ms.median == pytest.approx(
            statistics.median(run.times(plain, r.kernel.impl)) * 1e3)
        assert r.peer.impl == stats.fastest(run, r.shape, [i for i in run.impls_of(r.shape)
                                                            if res.is_peer(i)])
    text = build(run, tmp_path).markdown()
    assert "Attention variants" in text and "ALiBi" in text
    for r in rows:
        plain = replace(r.shape, alibi=False)
        assert (f"| {r.shape.family} {plain.label()} | ALiBi | `{r.kernel.impl}` | "
                f"{r.kernel.ms.text(3)} | {r.plain.ms.text(3)} | {r.vs_plain.text(3)} |") in text
    # The sweeps leave the ALiBi shapes out: a sweep over the prefill shapes themselves finds
    # the same shapes as without them.
    def sweep(results: res.Results) -> object:
        return plots._sweep(results, lambda s: s.family == "prefill", lambda s: (s.family,),
                            lambda s: s)
    assert sweep(run) is not None and sweep(run) == sweep(res.parse(raw))

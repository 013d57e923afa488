"""The cliff sweep's part of the report on committed results: fixtures/cliffs.json is a real
`mha_bench --size=cliffs` run (AMD EPYC Zen 3, 3 rounds) cut down to two kernels, two cache
configurations, two head widths and two groups. The expected figures are recomputed here from
the JSON itself, never typed in."""

from __future__ import annotations

import copy
import json
import re
import statistics
from pathlib import Path

import pytest

from mha_report import cliffs
from mha_report import results as res
from mha_report.render import build, summary_text, write

FIXTURE = Path(__file__).parent / "fixtures" / "cliffs.json"


@pytest.fixture(scope="module")
def raw() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def run(raw: dict) -> res.Results:
    return res.parse(raw, str(FIXTURE))


def test_the_name_grammar() -> None:
    shape, impl = res.parse_name(
        "cliffs/xsimd-avx2/caches:32K-256K/B:1/H:4/Hkv:1/Lq:1/Lk:4096/D:128/causal:1/"
        "threads:1/iterations:25/real_time")
    assert impl == "xsimd-avx2"
    assert isinstance(shape, res.CliffShape)
    assert (shape.caches, shape.group, shape.dim, shape.phase) == ("32K-256K", 4, 128, "decode")
    assert shape.name(impl) + "/iterations:25/real_time" == (
        "cliffs/xsimd-avx2/caches:32K-256K/B:1/H:4/Hkv:1/Lq:1/Lk:4096/D:128/causal:1/"
        "threads:1/iterations:25/real_time")


def test_every_point_is_parsed_and_kept_out_of_the_shape_tables(raw: dict,
                                                                 run: res.Results) -> None:
    assert len(run.runs) == len(raw["benchmarks"])
    assert all(isinstance(r.shape, res.CliffShape) for r in run.runs)
    assert run.shapes() == [] and run.all_shapes() == []
    assert cliffs.kernels(run) == ["xsimd-avx2", "avx2"]
    assert cliffs.configs(run) == ["native", "32K-256K"]


def best_rounds(raw: dict, kernel: str, phase: str) -> dict[str, float]:
    """Each point's best roof_frac, keyed by its name without the suffixes."""
    best: dict[str, float] = {}
    for b in raw["benchmarks"]:
        name = re.sub(r"/iterations:\d+/real_time$", "", b["name"])
        if name.split("/")[1] != kernel or ("/Lq:1/" in name) != (phase == "decode"):
            continue
        best[name] = max(best.get(name, 0.0), b["roof_frac"])
    return best


def test_summaries_take_each_points_best_round_and_the_median_of_the_grid(
        raw: dict, run: res.Results) -> None:
    summaries = cliffs.summaries(run)
    assert [(s.kernel, s.phase) for s in summaries] == [
        ("xsimd-avx2", "prefill"), ("xsimd-avx2", "decode"), ("avx2", "prefill"),
        ("avx2", "decode")]
    for s in summaries:
        want = best_rounds(raw, s.kernel, s.phase)
        assert {p.shape.name(s.kernel): p.roof_frac for p in s.points} == want
        assert s.median == pytest.approx(statistics.median(want.values()))
        assert s.worst.roof_frac == min(want.values())
        assert s.ratio == pytest.approx(min(want.values()) / statistics.median(want.values()))
        assert s.bar == (0.6 if s.kernel == "xsimd-avx2" else 0.7)
        assert s.passes == (s.ratio >= s.bar)


def test_a_planted_cliff_is_named_and_fails_the_bar(raw: dict) -> None:
    data = copy.deepcopy(raw)
    target = "cliffs/avx2/caches:32K-256K/B:1/H:4/Hkv:1/Lq:512/Lk:512/D:128/causal:0/threads:1"
    planted = [b for b in data["benchmarks"] if b["name"].startswith(target + "/")]
    assert len(planted) == 3  # one a round
    for b in planted:
        b["roof_frac"] = 0.05
    summary = next(s for s in cliffs.summaries(res.parse(data))
                   if s.kernel == "avx2" and s.phase == "prefill")
    assert summary.worst.shape.name("avx2") == target
    assert not summary.passes
    line = cliffs.worst_line(summary)
    assert "g=4 D=128 L=512, caches 32K-256K" in line and "below" in line
    # One slow round of three is noise, not a cliff: the best round counts.
    planted[0]["roof_frac"] = 0.8
    summary = next(s for s in cliffs.summaries(res.parse(data))
                   if s.kernel == "avx2" and s.phase == "prefill")
    assert summary.worst.shape.name("avx2") != target


def test_the_report_has_the_table_the_lines_and_a_heat_map_per_kernel(
        run: res.Results, tmp_path: Path) -> None:
    md, page = write(build(run, tmp_path), tmp_path)
    text = md.read_text()
    assert "## Cliffs: every tiled kernel" in text
    for s in cliffs.summaries(run):
        assert cliffs.worst_line(s) in text
    for kernel in cliffs.kernels(run):
        assert (tmp_path / f"cliffs_{kernel}.png").stat().st_size > 10_000
        assert f"![cliff sweep of {kernel}](cliffs_{kernel}.png)" in text
    assert "data:image/png;base64," in page.read_text()
    terminal = summary_text(run)
    assert "Cliffs" in terminal and "`" not in terminal
    assert terminal.count("worst point") == len(cliffs.summaries(run))

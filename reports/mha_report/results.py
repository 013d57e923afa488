"""Benchmark results as mha_bench writes them (Google Benchmark JSON), parsed into runs.

A run's name is ``<family>/<impl>/B:<b>/H:<h>/Hkv:<hkv>/Lq:<lq>/Lk:<lk>/D:<d>/causal:<c>/
threads:<n>`` with Google Benchmark's ``/real_time`` (kernels, baselines) or ``/manual_time``
(peers, timed in their own process) after it. With ``--rounds=N`` the same name appears N
times, in the order the rounds ran: the k-th occurrence of every name of a shape belongs to
round k, so implementations of one shape pair up round by round.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAME = re.compile(
    r"^(?P<family>[a-z]+)/(?P<impl>[^/]+)/B:(?P<batch>\d+)/H:(?P<heads>\d+)/Hkv:(?P<kv_heads>\d+)"
    r"/Lq:(?P<q_len>\d+)/Lk:(?P<kv_len>\d+)/D:(?P<dim>\d+)/causal:(?P<causal>[01])"
    r"/threads:(?P<threads>\d+)(?:/(?:real|manual)_time)?$")

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, order=True)
class Shape:
    family: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    dim: int
    causal: bool
    threads: int

    def name(self, impl: str = "*") -> str:
        return (f"{self.family}/{impl}/B:{self.batch}/H:{self.heads}/Hkv:{self.kv_heads}"
                f"/Lq:{self.q_len}/Lk:{self.kv_len}/D:{self.dim}/causal:{int(self.causal)}"
                f"/threads:{self.threads}")

    def label(self) -> str:
        """Short, for tables: 'H=32 Hkv=8 L=2048 D=128 causal, 1 thread'."""
        length = f"Lk={self.kv_len}" if self.family == "decode" else (
            f"L={self.q_len}" if self.q_len == self.kv_len else f"Lq={self.q_len} Lk={self.kv_len}")
        batch = f"B={self.batch} " if self.batch != 1 else ""
        return (f"{batch}H={self.heads} Hkv={self.kv_heads} {length} D={self.dim}"
                f"{' causal' if self.causal and self.family != 'decode' else ''}, "
                f"{self.threads} thread{'s' if self.threads > 1 else ''}")

    def kv_bytes(self) -> int:
        return self.batch * self.kv_heads * self.kv_len * self.dim * 2 * 4

    def io_bytes(self) -> int:
        """Unique bytes of q, k, v and o: the least traffic a call can have."""
        return self.kv_bytes() + 2 * self.batch * self.heads * self.q_len * self.dim * 4


def is_peer(impl: str) -> bool:
    return impl.startswith("peer-")


def is_kernel(impl: str) -> bool:
    """A registry kernel of this project (not a composed baseline, not a peer)."""
    return not is_peer(impl) and not impl.startswith("composed-")


@dataclass
class Run:
    shape: Shape
    impl: str
    seconds: float  # per call, wall clock (manual time for peers)
    counters: dict[str, float]
    label: str = ""
    error: str = ""


@dataclass
class Results:
    context: dict[str, Any]
    runs: list[Run]
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def shapes(self) -> list[Shape]:
        return sorted({r.shape for r in self.runs},
                      key=lambda s: (["prefill", "decode", "heads"].index(s.family)
                                     if s.family in ("prefill", "decode", "heads") else 9, s))

    def impls(self) -> list[str]:
        """Every implementation, in the order they first ran."""
        seen: dict[str, None] = {}
        for r in self.runs:
            seen.setdefault(r.impl, None)
        return list(seen)

    def times(self, shape: Shape, impl: str) -> list[float]:
        """Seconds per call of every round (errors left out)."""
        return [r.seconds for r in self.runs if r.shape == shape and r.impl == impl and not r.error]

    def counter(self, shape: Shape, impl: str, key: str) -> list[float]:
        return [r.counters[key] for r in self.runs
                if r.shape == shape and r.impl == impl and not r.error and key in r.counters]

    def errors(self) -> list[Run]:
        return [r for r in self.runs if r.error]

    def context_float(self, key: str) -> float | None:
        try:
            return float(self.context[key])
        except (KeyError, TypeError, ValueError):
            return None


def parse(data: dict[str, Any], source: str = "") -> Results:
    runs = []
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue  # aggregates: recomputed from the runs themselves
        m = NAME.match(b.get("name", ""))
        if m is None:
            continue
        g = m.groupdict()
        shape = Shape(g["family"], int(g["batch"]), int(g["heads"]), int(g["kv_heads"]),
                      int(g["q_len"]), int(g["kv_len"]), int(g["dim"]), g["causal"] == "1",
                      int(g["threads"]))
        error = b.get("error_message", "") if b.get("error_occurred") else ""
        seconds = float(b.get("real_time", 0.0)) * _UNIT_SECONDS[b.get("time_unit", "ns")]
        counters = {k: float(v) for k, v in b.items()
                    if k in ("GFLOPS", "peak_frac", "GBps", "bw_frac", "kv_bytes",
                             "dram_gbps_now", "l2_gbps_now", "peak_gflops_now")}
        runs.append(Run(shape, g["impl"], seconds, counters, b.get("label", ""), error))
    return Results(dict(data.get("context", {})), runs, source, data)


def load(path: str | Path) -> Results:
    with open(path, encoding="utf-8") as f:
        return parse(json.load(f), str(path))

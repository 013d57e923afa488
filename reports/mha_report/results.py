"""Benchmark results as mha_bench writes them (Google Benchmark JSON), parsed into runs.

A run's name is ``<family>/<impl>/B:<b>/H:<h>/Hkv:<hkv>/Lq:<lq>/Lk:<lk>/D:<d>/causal:<c>
[/kv:<type>][/sinks:1][/window:<w>][/softcap:<cap>][/alibi:1]/threads:<n>`` (``/sinks:1``: with
attention sinks; ``/window:<w>``: a sliding window of w keys; ``/softcap:<cap>``: logits
soft-capped at cap, a float as C++ streams it: ``20``, ``0.5``, ``1e-05``; ``/alibi:1``: ALiBi's
biases, the paper's slopes) with Google Benchmark's ``/real_time`` (kernels, baselines) or
``/manual_time`` (peers, timed in their own process) after it. With ``--rounds=N`` the same
name appears N times, in the order the rounds ran: the k-th occurrence of every name of a shape
belongs to round k, so implementations of one shape pair up round by round.

Two more families measure what surrounds attention (bench/layer_bench.h):

- ``gemm/<impl>/M:<m>/N:<n>/K:<k>/threads:<t>``: C = A B with a packed weight B, for the
  project's GEMM kernels, the libraries (openblas, onednn) and peer-torch-matmul;
- ``layer/<impl>/B:<b>/d:<d>/H:<h>/Hkv:<hkv>/D:<D>/n:<n>/Lk:<lk>/causal:<c>[/kv:<type>]/threads:<t>``:
  the whole attention layer for n new tokens at Lk keys (n > 1: prefill; n = 1 after a
  cache: one decode step), the project's (named by its GEMM kernel), the composed baselines
  (``composed-*``) and peer-torch-layer.

Their runs are parsed into GemmShape and LayerShape runs beside the attention ones; the
statistics (stats.py) take any of the three shapes.

The ``ragged`` family is a decode step of B sequences whose caches hold different numbers of
keys (mha::Problem::kv_lens): ``Lk`` is the caches' capacity, the lengths are spread evenly
from Lk / 32 to Lk (ragged_lengths, as bench/main.cpp makes them).

The cliff sweep (``cliffs/<kernel>/caches:<config>/B:.../threads:1/iterations:<n>``) times
every tiled kernel under several cache configurations (``native``: this CPU's own; else
``<L1d>-<L2>``, the tiling of another machine), head widths and groups, prefill (Lq = Lk) and
decode (Lq = 1); its runs are CliffShape runs, summarized by cliffs.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

NAME = re.compile(
    r"^(?P<family>[a-z]+)/(?P<impl>[^/]+)/B:(?P<batch>\d+)/H:(?P<heads>\d+)/Hkv:(?P<kv_heads>\d+)"
    r"/Lq:(?P<q_len>\d+)/Lk:(?P<kv_len>\d+)/D:(?P<dim>\d+)/causal:(?P<causal>[01])"
    r"(?:/kv:(?P<kv>f16|bf16|i8))?(?P<sinks>/sinks:1)?(?:/window:(?P<window>\d+))?"
    r"(?:/softcap:(?P<softcap>\d+(?:\.\d*)?(?:e[+-]\d+)?))?(?P<alibi>/alibi:1)?"
    r"/threads:(?P<threads>\d+)(?:/(?:real|manual)_time)?$")
CLIFF_NAME = re.compile(
    r"^cliffs/(?P<impl>[^/]+)/caches:(?P<caches>[^/]+)/B:(?P<batch>\d+)/H:(?P<heads>\d+)"
    r"/Hkv:(?P<kv_heads>\d+)/Lq:(?P<q_len>\d+)/Lk:(?P<kv_len>\d+)/D:(?P<dim>\d+)"
    r"/causal:(?P<causal>[01])/threads:(?P<threads>\d+)(?:/iterations:\d+)?"
    r"(?:/(?:real|manual)_time)?$")
GEMM_NAME = re.compile(
    r"^gemm/(?P<impl>[^/]+)/M:(?P<m>\d+)/N:(?P<n>\d+)/K:(?P<k>\d+)"
    r"/threads:(?P<threads>\d+)(?:/(?:real|manual)_time)?$")
LAYER_NAME = re.compile(
    r"^layer/(?P<impl>[^/]+)/B:(?P<batch>\d+)/d:(?P<d>\d+)/H:(?P<heads>\d+)"
    r"/Hkv:(?P<kv_heads>\d+)/D:(?P<dim>\d+)/n:(?P<new_tokens>\d+)/Lk:(?P<kv_len>\d+)"
    r"/causal:(?P<causal>[01])(?:/kv:(?P<kv>f16|bf16|i8))?/threads:(?P<threads>\d+)"
    r"(?:/(?:real|manual)_time)?$")

# The libraries the gemm family compares with (every other non-peer gemm is a kernel of
# this project: portable, avx2, avx512, neon, ...).
GEMM_LIBRARIES = ("openblas", "onednn")
COUNTERS = ("GFLOPS", "peak_frac", "GBps", "bw_frac", "kv_bytes", "kv_cache_bytes",
            "dram_gbps_now", "l2_gbps_now", "l3_gbps_now", "peak_gflops_now", "roof_frac",
            "kv_err_max", "kv_err_rms")

# Bytes of one stored K or V element by KV type (an i8 row adds its 4-byte scale).
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1}

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def ragged_lengths(batch: int, kv_len: int) -> list[int]:
    """The keys of each sequence of a ragged shape (bench/main.cpp's ragged_lengths): B
    lengths evenly spread from Lk / 32 to Lk."""
    shortest = max(1, kv_len // 32)
    if batch == 1:
        return [kv_len]
    return [shortest + (kv_len - shortest) * b // (batch - 1) for b in range(batch)]


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
    kv: str = "f32"  # K and V as stored: f32, f16, bf16 or i8 ("/kv:<type>" unless f32)
    sinks: bool = False  # attention sinks ("/sinks:1")
    window: int = 0  # a sliding window of that many keys ("/window:<w>" unless 0)
    softcap: float = 0.0  # logits soft-capped at this ("/softcap:<c>" unless 0: none)
    alibi: bool = False  # ALiBi's biases ("/alibi:1")

    def name(self, impl: str = "*") -> str:
        kv = "" if self.kv == "f32" else f"/kv:{self.kv}"
        return (f"{self.family}/{impl}/B:{self.batch}/H:{self.heads}/Hkv:{self.kv_heads}"
                f"/Lq:{self.q_len}/Lk:{self.kv_len}/D:{self.dim}/causal:{int(self.causal)}"
                f"{kv}{'/sinks:1' if self.sinks else ''}"
                f"{f'/window:{self.window}' if self.window else ''}"
                f"{f'/softcap:{self.softcap:g}' if self.softcap else ''}"
                f"{'/alibi:1' if self.alibi else ''}/threads:{self.threads}")

    @property
    def decode(self) -> bool:
        """One new query row per head against a KV cache: decode and ragged."""
        return self.family in ("decode", "ragged")

    def label(self) -> str:
        """Short, for tables: 'H=32 Hkv=8 L=2048 D=128 causal, 1 thread'; a ragged batch's
        keys as 'Lk=1024..32768'."""
        if self.family == "ragged":
            lens = ragged_lengths(self.batch, self.kv_len)
            length = f"Lk={lens[0]}..{lens[-1]}"
        elif self.family == "decode":
            length = f"Lk={self.kv_len}"
        else:
            length = (f"L={self.q_len}" if self.q_len == self.kv_len
                      else f"Lq={self.q_len} Lk={self.kv_len}")
        batch = f"B={self.batch} " if self.batch != 1 else ""
        kv = (("" if self.kv == "f32" else f" KV {self.kv}") + (" sinks" if self.sinks else "")
              + (f" window {self.window}" if self.window else "")
              + (f" softcap {self.softcap:g}" if self.softcap else "")
              + (" ALiBi" if self.alibi else ""))
        return (f"{batch}H={self.heads} Hkv={self.kv_heads} {length} D={self.dim}"
                f"{' causal' if self.causal and not self.decode else ''}{kv}, "
                f"{self.threads} thread{'s' if self.threads > 1 else ''}")

    def kv_bytes(self) -> int:
        """Bytes of K and V as stored that a call reads: elements of the KV type, and i8's row
        scales; with a sliding window, its keys and one more per query row after the first."""
        row = self.dim * KV_TYPE_BYTES[self.kv] + (4 if self.kv == "i8" else 0)
        keys = (sum(ragged_lengths(self.batch, self.kv_len)) if self.family == "ragged"
                else self.batch * self.kv_len)
        if self.window and self.family != "ragged":
            keys = self.batch * min(self.kv_len, self.window + self.q_len - 1)
        return self.kv_heads * keys * row * 2

    def io_bytes(self) -> int:
        """Unique bytes of q, k, v and o: the least traffic a call can have."""
        return self.kv_bytes() + 2 * self.batch * self.heads * self.q_len * self.dim * 4


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


@dataclass(frozen=True, order=True)
class GemmShape:
    """C [m][n] = A [m][k] B [k][n]: m tokens through a k x n weight."""
    family: ClassVar[str] = "gemm"
    m: int
    n: int
    k: int
    threads: int

    def name(self, impl: str = "*") -> str:
        return f"gemm/{impl}/M:{self.m}/N:{self.n}/K:{self.k}/threads:{self.threads}"

    def label(self) -> str:
        """Short, for tables: 'M=1 N=4096 K=4096, 1 thread'."""
        return f"M={self.m} N={self.n} K={self.k}, {_threads(self.threads)}"


@dataclass(frozen=True, order=True)
class LayerShape:
    """The whole attention layer: n new tokens of width d, attending to Lk keys (the cache
    holds Lk - n earlier ones)."""
    family: ClassVar[str] = "layer"
    batch: int
    d: int
    heads: int
    kv_heads: int
    dim: int
    new_tokens: int
    kv_len: int
    causal: bool
    threads: int
    kv: str = "f32"  # the cache's element type ("/kv:<type>" unless f32)

    @property
    def step(self) -> str:
        """'decode' for one new token after a cache, else 'prefill'."""
        return "decode" if self.new_tokens == 1 and self.kv_len > 1 else "prefill"

    def name(self, impl: str = "*") -> str:
        return (f"layer/{impl}/B:{self.batch}/d:{self.d}/H:{self.heads}/Hkv:{self.kv_heads}"
                f"/D:{self.dim}/n:{self.new_tokens}/Lk:{self.kv_len}/causal:{int(self.causal)}"
                f"{'' if self.kv == 'f32' else '/kv:' + self.kv}/threads:{self.threads}")

    def label(self, kv_heads: bool = True) -> str:
        """Short, for tables: 'd=4096 H=32 Hkv=8 D=128 n=2048 causal, 1 thread' (prefill) or
        'd=4096 H=32 Hkv=8 D=128 Lk=8192, 1 thread' (decode); without Hkv= if not kv_heads."""
        if self.step == "decode":
            tokens = f"Lk={self.kv_len}"
        elif self.kv_len == self.new_tokens:
            tokens = f"n={self.new_tokens}{' causal' if self.causal else ''}"
        else:
            tokens = f"n={self.new_tokens} Lk={self.kv_len}{' causal' if self.causal else ''}"
        batch = f"B={self.batch} " if self.batch != 1 else ""
        hkv = f" Hkv={self.kv_heads}" if kv_heads else ""
        kv = "" if self.kv == "f32" else f" KV {self.kv}"
        return (f"{batch}d={self.d} H={self.heads}{hkv} D={self.dim} {tokens}{kv}, "
                f"{_threads(self.threads)}")


@dataclass(frozen=True, order=True)
class CliffShape:
    """A point of the cliff sweep: one KV head, g = heads query heads, 1 thread, the kernels
    tiling for the cache configuration `caches`."""
    family: ClassVar[str] = "cliffs"
    caches: str
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    dim: int
    causal: bool
    batch: int = 1
    threads: int = 1

    @property
    def phase(self) -> str:
        return "decode" if self.q_len == 1 else "prefill"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def name(self, impl: str = "*") -> str:
        return (f"cliffs/{impl}/caches:{self.caches}/B:{self.batch}/H:{self.heads}"
                f"/Hkv:{self.kv_heads}/Lq:{self.q_len}/Lk:{self.kv_len}/D:{self.dim}"
                f"/causal:{int(self.causal)}/threads:{self.threads}")

    def label(self) -> str:
        """'prefill g=4 D=16 L=512, caches 32K-256K'."""
        length = f"Lk={self.kv_len}" if self.phase == "decode" else f"L={self.q_len}"
        return f"{self.phase} g={self.group} D={self.dim} {length}, caches {self.caches}"


AnyShape = Shape | GemmShape | LayerShape | CliffShape


def sharing(heads: int, kv_heads: int) -> str:
    """MHA, GQA (with its group size: query heads per KV head) or MQA."""
    if kv_heads == heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else f"GQA g={heads // kv_heads}"


def is_peer(impl: str) -> bool:
    return impl.startswith("peer-")


def is_kernel(impl: str) -> bool:
    """A registry kernel of this project (not a composed baseline, not a peer)."""
    return not is_peer(impl) and not impl.startswith("composed-")


def is_library(impl: str) -> bool:
    """A BLAS library of the gemm family (openblas, onednn)."""
    return impl in GEMM_LIBRARIES


def is_composed(impl: str) -> bool:
    """A baseline composed from a library's sgemm (attention and layer families)."""
    return impl.startswith("composed-")


def is_own(shape: AnyShape, impl: str) -> bool:
    """This project's implementation of the shape: an attention kernel, a GEMM kernel (not a
    library) or the project's layer (named by its GEMM kernel)."""
    return is_kernel(impl) and not (isinstance(shape, GemmShape) and is_library(impl))


@dataclass
class Run:
    shape: AnyShape
    impl: str
    seconds: float  # per call, wall clock (manual time for peers)
    counters: dict[str, float]
    label: str = ""
    error: str = ""
    round: int = 0  # k - 1 for the k-th occurrence of its name


@dataclass
class Results:
    context: dict[str, Any]
    runs: list[Run]
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def shapes(self) -> list[Shape]:
        """The attention shapes (prefill, decode, heads, then any other family)."""
        return sorted({r.shape for r in self.runs if isinstance(r.shape, Shape)},
                      key=lambda s: (["prefill", "decode", "heads"].index(s.family)
                                     if s.family in ("prefill", "decode", "heads") else 9, s))

    def gemm_shapes(self) -> list[GemmShape]:
        """By M, N, K, then threads."""
        return sorted({r.shape for r in self.runs if isinstance(r.shape, GemmShape)})

    def layer_shapes(self) -> list[LayerShape]:
        """Prefill before decode, then by width, heads, KV heads (most first), length and
        threads."""
        return sorted({r.shape for r in self.runs if isinstance(r.shape, LayerShape)},
                      key=lambda s: (s.step != "prefill", s.d, s.heads, -s.kv_heads, s.dim,
                                     s.new_tokens, s.kv_len, s.batch, s.causal, s.threads))

    def cliff_shapes(self) -> list[CliffShape]:
        return sorted({r.shape for r in self.runs if isinstance(r.shape, CliffShape)})

    def all_shapes(self) -> list[AnyShape]:
        """The shapes the tables and the comparison with a baseline cover (not the cliff
        sweep's points: cliffs.py summarizes those)."""
        return [*self.shapes(), *self.gemm_shapes(), *self.layer_shapes()]

    def impls(self) -> list[str]:
        """Every implementation, in the order they first ran."""
        seen: dict[str, None] = {}
        for r in self.runs:
            seen.setdefault(r.impl, None)
        return list(seen)

    def impls_of(self, shape: AnyShape) -> list[str]:
        """The implementations that ran the shape (errors included), in the order they ran."""
        seen: dict[str, None] = {}
        for r in self.runs:
            if r.shape == shape:
                seen.setdefault(r.impl, None)
        return list(seen)

    def times(self, shape: AnyShape, impl: str) -> list[float]:
        """Seconds per call of every round (errors left out)."""
        return [r.seconds for r in self.runs if r.shape == shape and r.impl == impl and not r.error]

    def round_times(self, shape: AnyShape, impl: str) -> dict[int, float]:
        """Seconds per call by round (rounds with an error left out)."""
        return {r.round: r.seconds for r in self.runs
                if r.shape == shape and r.impl == impl and not r.error}

    def failed(self, shape: AnyShape, impl: str) -> bool:
        """Whether the implementation ran the shape only with errors."""
        mine = [r for r in self.runs if r.shape == shape and r.impl == impl]
        return bool(mine) and all(r.error for r in mine)

    def counter(self, shape: AnyShape, impl: str, key: str) -> list[float]:
        return [r.counters[key] for r in self.runs
                if r.shape == shape and r.impl == impl and not r.error and key in r.counters]

    def errors(self) -> list[Run]:
        return [r for r in self.runs if r.error]

    def context_float(self, key: str) -> float | None:
        try:
            return float(self.context[key])
        except (KeyError, TypeError, ValueError):
            return None


def parse_name(name: str) -> tuple[AnyShape, str] | None:
    """The shape and implementation a benchmark name stands for; None for other names."""
    if m := CLIFF_NAME.match(name):
        g = {k: int(v) for k, v in m.groupdict().items() if k not in ("impl", "caches")}
        return CliffShape(m["caches"], g["heads"], g["kv_heads"], g["q_len"], g["kv_len"],
                          g["dim"], g["causal"] == 1, g["batch"], g["threads"]), m["impl"]
    if m := GEMM_NAME.match(name):
        g = {k: int(v) for k, v in m.groupdict().items() if k != "impl"}
        return GemmShape(g["m"], g["n"], g["k"], g["threads"]), m["impl"]
    if m := LAYER_NAME.match(name):
        g = {k: int(v) for k, v in m.groupdict().items() if k not in ("impl", "kv")}
        return LayerShape(g["batch"], g["d"], g["heads"], g["kv_heads"], g["dim"],
                          g["new_tokens"], g["kv_len"], g["causal"] == 1, g["threads"],
                          m["kv"] or "f32"), m["impl"]
    if m := NAME.match(name):
        g = m.groupdict()
        return Shape(g["family"], int(g["batch"]), int(g["heads"]), int(g["kv_heads"]),
                     int(g["q_len"]), int(g["kv_len"]), int(g["dim"]), g["causal"] == "1",
                     int(g["threads"]), g["kv"] or "f32", g["sinks"] is not None,
                     int(g["window"] or 0), float(g["softcap"] or 0.0),
                     g["alibi"] is not None), g["impl"]
    return None


def parse(data: dict[str, Any], source: str = "") -> Results:
    runs = []
    seen: dict[tuple[AnyShape, str], int] = {}  # occurrences so far: the next run's round
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue  # aggregates: recomputed from the runs themselves
        parsed = parse_name(b.get("name", ""))
        if parsed is None:
            continue
        shape, impl = parsed
        error = b.get("error_message", "") if b.get("error_occurred") else ""
        seconds = float(b.get("real_time", 0.0)) * _UNIT_SECONDS[b.get("time_unit", "ns")]
        counters = {k: float(v) for k, v in b.items() if k in COUNTERS}
        round_ = seen.get((shape, impl), 0)
        seen[(shape, impl)] = round_ + 1
        runs.append(Run(shape, impl, seconds, counters, b.get("label", ""), error, round_))
    return Results(dict(data.get("context", {})), runs, source, data)


def load(path: str | Path) -> Results:
    with open(path, encoding="utf-8") as f:
        return parse(json.load(f), str(path))

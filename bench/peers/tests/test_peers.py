"""Each framework peer against attention in float64 on small problems of every kind the
benchmarks time and a few they do not (bottom-right causal with q_len < kv_len, padded
strides), the GEMM and layer peers against their float64 references under derived bounds,
and the server's protocol end to end. Framework tests skip when the framework is not
installed (the report's environment has none of them)."""

from __future__ import annotations

import io
import math
import mmap
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from mha_peers.frameworks import (ALL, ATTENTION, Framework, OpenVinoSdpaKvCache, Peer,
                                  TorchLayer, TorchMatmul, TorchSdpa)
from mha_peers.layer import Gemm, GemmTensors, Layer, LayerReference, LayerTensors, layer
from mha_peers.problem import (Mask, Problem, Tensors, attention, dense_head_major,
                               dense_token_major, view)
from mha_peers.server import Server, serve


def make_problem(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int,
                 causal: bool, kv_head_major: bool = False, pad: int = 0,
                 kv_lens: tuple[int, ...] | None = None,
                 sinks: tuple[float, ...] | None = None, window: int = 0,
                 softcap: float = 0.0, logits: float = 1.0,
                 alibi: tuple[float, ...] | None = None, alibi_offset: int = 0) -> Problem:
    """Token-major q and o; k and v token- or head-major; `pad` floats after every row; the
    scale `logits` / sqrt(dim), logits times the usual (inputs in [-1, 1] give logits of
    about 1/3 times `logits`)."""
    def strides(length: int, h: int, head_major: bool) -> tuple[int, int, int]:
        row = dim + pad
        if head_major:
            return (h * length * row, row, length * row)
        return (length * h * row, h * row, row)

    return Problem(batch, q_len, kv_len, heads, kv_heads, dim, causal, logits / math.sqrt(dim),
                   strides(q_len, heads, False), strides(kv_len, kv_heads, kv_head_major),
                   strides(kv_len, kv_heads, kv_head_major), strides(q_len, heads, False),
                   kv_lens=kv_lens, sinks=sinks, window=window, softcap=softcap, alibi=alibi,
                   alibi_offset=alibi_offset)


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """ALiBi's slopes for `heads` query heads as the paper gives them (and the benchmark uses
    them), 2^(-8 (h + 1) / heads), each rounded to fp32 as mha::Problem holds it."""
    return tuple(float(np.float32(2.0 ** (-8 * (h + 1) / heads))) for h in range(heads))


def extent(p: Problem, length: int, heads: int, strides: tuple[int, int, int]) -> int:
    b, s, h = strides
    return (p.batch - 1) * b + (length - 1) * s + (heads - 1) * h + p.head_dim


def buffers(p: Problem, rng: np.random.Generator, copies: int = 1):
    def rand(n: int) -> np.ndarray:
        return rng.uniform(-1, 1, n).astype(np.float32)

    q = [rand(extent(p, p.q_len, p.q_heads, p.q_strides))]
    k = [rand(extent(p, p.kv_len, p.kv_heads, p.k_strides)) for _ in range(copies)]
    v = [rand(extent(p, p.kv_len, p.kv_heads, p.v_strides)) for _ in range(copies)]
    o = np.full(extent(p, p.q_len, p.q_heads, p.o_strides), np.nan, dtype=np.float32)
    return q, k, v, o


def error_bound(p: Problem) -> float:
    """|o - exact| for inputs in [-1, 1], u = 2^-24: logits err by e_s = (D + 1) D scale u
    (the fp32 dot product and the scaling; (D + 1) sqrt(D) u at the usual scale), a capped
    logit by no more (c tanh(s / c) has slope at most 1) plus 4 u c for its tanh
    (reference/tolerance.h, kSoftcapError), a biased one (ALiBi) by 2 u A more for the bias
    rounded to fp32 and the addition, A the largest |bias| of a key a row sees; each weight
    exp(s - max) relatively by 2 e_s, u |s - max| for the subtraction (counted as u, or 2 u c
    when capped, plus u A when biased), 16 u for an exp within 8 ulp (the peers' bound in
    bench/main.cpp) and 3 u per key for an online softmax that rescales at every key (the
    worst blocking); the output by twice the weights' error plus the two sums of n terms and
    the division."""
    u = 2.0 ** -24
    e_s = (p.head_dim + 1) * p.head_dim * p.scale * u
    span = 1.0
    if p.soft_capped:
        e_s += 4 * u * p.softcap
        span = max(span, 2 * p.softcap)
    if p.has_alibi:
        biggest = float(np.abs(np.where(p.sequences_visible(), p.alibi_bias(), 0.0)).max())
        e_s += 2 * u * biggest
        span += biggest
    e_w = 2 * e_s + (16 + span) * u + 3 * u * p.kv_len
    return 2 * e_w + (2 * p.kv_len + 1) * u


CASES = {
    "prefill": dict(batch=1, q_len=37, kv_len=37, heads=4, kv_heads=4, dim=32, causal=False),
    "prefill-causal-gqa": dict(batch=2, q_len=40, kv_len=40, heads=8, kv_heads=2, dim=64,
                               causal=True),
    "mqa": dict(batch=1, q_len=24, kv_len=24, heads=6, kv_heads=1, dim=16, causal=False),
    "decode-head-major": dict(batch=2, q_len=1, kv_len=300, heads=8, kv_heads=2, dim=64,
                              causal=True, kv_head_major=True),
    "causal-lq<lk": dict(batch=1, q_len=5, kv_len=33, heads=4, kv_heads=2, dim=32,
                         causal=True, kv_head_major=True),
    "causal-lq<lk-token-major": dict(batch=1, q_len=7, kv_len=20, heads=2, kv_heads=1, dim=8,
                                     causal=True),
    "padded": dict(batch=2, q_len=9, kv_len=17, heads=4, kv_heads=2, dim=24, causal=False,
                   pad=3),
    "decode-mqa-token-major": dict(batch=1, q_len=1, kv_len=77, heads=6, kv_heads=1, dim=32,
                                   causal=True),
    "decode-padded": dict(batch=2, q_len=1, kv_len=19, heads=4, kv_heads=2, dim=24,
                          causal=False, pad=3),
    # Ragged batches (Problem.kv_lens): a decode step of sequences of their own cache lengths,
    # and a non-causal batch of several query rows.
    "decode-ragged": dict(batch=3, q_len=1, kv_len=300, heads=8, kv_heads=2, dim=64,
                          causal=True, kv_head_major=True, kv_lens=(300, 17, 150)),
    "ragged-rows": dict(batch=2, q_len=6, kv_len=40, heads=4, kv_heads=4, dim=16,
                        causal=False, kv_lens=(9, 40)),
    # Attention sinks (Problem.sinks): weighing about as much as the keys (logits of inputs
    # in [-1, 1] are within a few units of 0, their lse about log(Lk)), and little.
    "prefill-causal-sinks": dict(batch=2, q_len=30, kv_len=30, heads=4, kv_heads=2, dim=32,
                                 causal=True, sinks=(3.0, 0.5, -2.0, 1.5)),
    "decode-sinks": dict(batch=1, q_len=1, kv_len=200, heads=4, kv_heads=1, dim=32,
                         causal=True, kv_head_major=True, sinks=(5.0, 5.3, 2.0, -4.0)),
    # Sliding windows (Problem.window): a causal prefill's rows each their own window, with
    # a cache before them too, without causal masking, and a decode step's shared window
    # (sliced off by the server: Problem.sliced).
    "prefill-causal-window": dict(batch=2, q_len=30, kv_len=30, heads=4, kv_heads=2, dim=32,
                                  causal=True, window=7),
    "prefill-past-window": dict(batch=1, q_len=10, kv_len=40, heads=4, kv_heads=1, dim=16,
                                causal=True, window=12),
    "prefill-window-not-causal": dict(batch=1, q_len=9, kv_len=20, heads=2, kv_heads=2,
                                      dim=16, causal=False, window=5),
    "decode-window": dict(batch=2, q_len=1, kv_len=200, heads=8, kv_heads=2, dim=32,
                          causal=True, kv_head_major=True, window=50),
    "ragged-window": dict(batch=2, q_len=1, kv_len=60, heads=4, kv_heads=2, dim=16,
                          causal=True, kv_head_major=True, kv_lens=(60, 25), window=30),
    # Logit soft-capping (Problem.softcap): logits of about 5 (15 times the usual scale, so
    # the scale is not 1 / sqrt(D) either) capped at 2, where c tanh(s / c) is far from s and
    # from a cap of the unscaled q.k; without causal masking, causal, bottom-right causal
    # through a mask, a decode step, with a sliding window, and with sinks above the cap
    # (which stay uncapped).
    "prefill-softcap": dict(batch=1, q_len=24, kv_len=24, heads=4, kv_heads=2, dim=32,
                            causal=False, softcap=2.0, logits=15.0),
    "prefill-causal-softcap": dict(batch=2, q_len=30, kv_len=30, heads=8, kv_heads=2,
                                   dim=32, causal=True, softcap=2.0, logits=15.0),
    "causal-lq<lk-softcap": dict(batch=1, q_len=5, kv_len=33, heads=4, kv_heads=2, dim=32,
                                 causal=True, kv_head_major=True, softcap=2.0, logits=15.0),
    "decode-softcap": dict(batch=2, q_len=1, kv_len=200, heads=8, kv_heads=2, dim=64,
                           causal=True, kv_head_major=True, softcap=2.0, logits=15.0),
    "prefill-causal-window-softcap": dict(batch=1, q_len=30, kv_len=30, heads=4, kv_heads=2,
                                          dim=32, causal=True, window=7, softcap=2.0,
                                          logits=15.0),
    "prefill-causal-sinks-softcap": dict(batch=2, q_len=30, kv_len=30, heads=4, kv_heads=2,
                                         dim=32, causal=True, sinks=(3.0, 0.5, -2.0, 1.5),
                                         softcap=2.0, logits=15.0),
    "decode-sinks-softcap": dict(batch=1, q_len=1, kv_len=200, heads=4, kv_heads=1, dim=32,
                                 causal=True, kv_head_major=True, sinks=(6.0, 4.0, 2.5, -3.0),
                                 softcap=2.0, logits=15.0),
    # ALiBi (Problem.alibi), the paper's slopes (2^-1 .. 2^-8 for 8 heads, 2^-2 .. 2^-8 for 4):
    # without causal masking (the distance's both sides), causal, bottom-right causal and
    # q_len < kv_len without it (the row's position i + kv_len - q_len), nonzero offsets (one
    # with 4 times the usual scale), decode steps (the grouped forms: each query head its own
    # slope), ragged batches (each sequence's own positions), a row's own window and a shared
    # one (sliced off: the positions stay), with a soft-cap (the bias after it) and with sinks
    # (not biased).
    "prefill-alibi": dict(batch=1, q_len=24, kv_len=24, heads=4, kv_heads=2, dim=32,
                          causal=False, alibi=alibi_slopes(4)),
    "prefill-causal-alibi": dict(batch=2, q_len=30, kv_len=30, heads=8, kv_heads=2, dim=32,
                                 causal=True, alibi=alibi_slopes(8)),
    "causal-lq<lk-alibi": dict(batch=1, q_len=5, kv_len=33, heads=4, kv_heads=2, dim=32,
                               causal=True, kv_head_major=True, alibi=alibi_slopes(4)),
    "lq<lk-alibi": dict(batch=2, q_len=7, kv_len=20, heads=4, kv_heads=1, dim=8, causal=False,
                        alibi=alibi_slopes(4)),
    "causal-lq<lk-alibi-offset": dict(batch=1, q_len=6, kv_len=20, heads=4, kv_heads=2,
                                      dim=16, causal=True, alibi=alibi_slopes(4),
                                      alibi_offset=-5),
    "prefill-alibi-offset": dict(batch=1, q_len=16, kv_len=16, heads=4, kv_heads=4, dim=16,
                                 causal=False, logits=4.0, alibi=alibi_slopes(4),
                                 alibi_offset=3),
    "decode-alibi": dict(batch=2, q_len=1, kv_len=200, heads=8, kv_heads=2, dim=64,
                         causal=True, kv_head_major=True, alibi=alibi_slopes(8)),
    "decode-mqa-alibi": dict(batch=1, q_len=1, kv_len=77, heads=4, kv_heads=1, dim=32,
                             causal=True, alibi=alibi_slopes(4), alibi_offset=2),
    "decode-ragged-alibi": dict(batch=3, q_len=1, kv_len=120, heads=8, kv_heads=2, dim=32,
                                causal=True, kv_head_major=True, kv_lens=(120, 17, 60),
                                alibi=alibi_slopes(8)),
    "ragged-rows-alibi": dict(batch=2, q_len=6, kv_len=40, heads=4, kv_heads=4, dim=16,
                              causal=False, kv_lens=(9, 40), alibi=alibi_slopes(4)),
    "prefill-causal-window-alibi": dict(batch=1, q_len=30, kv_len=30, heads=4, kv_heads=2,
                                        dim=32, causal=True, window=7, alibi=alibi_slopes(4)),
    "decode-window-alibi": dict(batch=2, q_len=1, kv_len=200, heads=8, kv_heads=2, dim=32,
                                causal=True, kv_head_major=True, window=50,
                                alibi=alibi_slopes(8)),
    "prefill-causal-softcap-alibi": dict(batch=2, q_len=30, kv_len=30, heads=4, kv_heads=2,
                                         dim=32, causal=True, softcap=2.0, logits=15.0,
                                         alibi=alibi_slopes(4)),
    "causal-lq<lk-softcap-alibi": dict(batch=1, q_len=5, kv_len=33, heads=4, kv_heads=2,
                                       dim=32, causal=True, kv_head_major=True, softcap=2.0,
                                       logits=15.0, alibi=alibi_slopes(4)),
    "prefill-causal-sinks-alibi": dict(batch=2, q_len=30, kv_len=30, heads=4, kv_heads=2,
                                       dim=32, causal=True, sinks=(3.0, 0.5, -2.0, 1.5),
                                       alibi=alibi_slopes(4)),
    "decode-sinks-softcap-alibi": dict(batch=1, q_len=1, kv_len=200, heads=4, kv_heads=1,
                                       dim=32, causal=True, kv_head_major=True,
                                       sinks=(6.0, 4.0, 2.5, -3.0), softcap=2.0, logits=15.0,
                                       alibi=alibi_slopes(4)),
}


def loaded(cls: type[Framework]) -> Framework:
    peer = cls()
    try:
        peer.load()
    except ImportError as e:
        pytest.skip(f"{peer.name}: {e}")
    return peer


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cls", ATTENTION, ids=lambda c: c.name)
def test_peer_matches_attention_in_double(cls: type[Peer], case: str) -> None:
    peer = loaded(cls)
    assert isinstance(peer, Peer)
    whole = make_problem(**CASES[case])
    p = whole.sliced()  # as the server calls a peer: a window every row shares sliced off
    why = peer.why_unsupported(p)
    if why is not None:
        # The peers that decline: ORT's GQA operator (causal only), the grouped forms
        # (grouped-query decode steps only), OpenVINO's KV-cache form (prefill and decode).
        # A ragged batch: the peers without per-sequence lengths, and ORT's GQA operator
        # beyond decode steps. Sinks, a window, a soft-cap, ALiBi: the peers whose operator has
        # none; ALiBi in decode: OpenVINO's KV-cache form.
        assert ((cls.name == "peer-ort-gqa" and not p.causal)
                or (cls.name.endswith("-grouped") and not p.grouped_decode)
                or (cls is OpenVinoSdpaKvCache and p.q_len not in (1, p.kv_len))
                or (p.kv_lens is not None and not cls.ragged)
                or (p.sinks is not None and not cls.sinks)
                or (0 < p.window < p.kv_len and not cls.window)
                or (p.soft_capped and not cls.softcap)
                or (p.has_alibi and not cls.alibi)
                or (cls is OpenVinoSdpaKvCache and p.has_alibi and p.q_len != p.kv_len)
                or (cls.name == "peer-ort-gqa" and p.kv_lens is not None and p.q_len != 1))
        pytest.skip(why)
    rng = np.random.default_rng(7)
    q, k, v, o = buffers(whole, rng, copies=2)
    inputs = [x.copy() for x in q + k + v]
    t = Tensors.from_buffers(whole, q, k, v, o)
    t_whole, t = t, t.sliced(whole)
    call = peer.prepare(p, t, threads=1)
    # The last call, on copy 0, is the one written out; OpenVINO's KV-cache decode appends
    # its key to the cache at every call, as a generation step does: one call.
    steps = (0,) if cls is OpenVinoSdpaKvCache and p.q_len == 1 else (1, 0)
    for c in steps:
        call(c)
    peer.write_output(p, t)
    # Inputs are read only (ORT's GQA writes each new key back to the cache row it came from).
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(inputs, q + k + v)), (
        f"{peer.name} on {case} changed its inputs")
    want = attention(whole, t_whole.q[0], t_whole.k[0], t_whole.v[0])
    err = np.abs(t.o - want).max()
    assert err <= error_bound(p), f"{peer.name} on {case}: max |error| {err:.3g}"


def rounded(x: np.ndarray, kv_type: str) -> tuple[np.ndarray, np.ndarray]:
    """x (float32) rounded to f16 or bf16 (to nearest, ties to even): its bits in a float32
    buffer (as mha_bench's memfd tensors hold them) and its values widened to float32."""
    if kv_type == "f16":
        bits = x.astype(np.float16).view(np.uint16)
    else:
        u = x.view(np.uint32).astype(np.uint64)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    wide = (bits.astype(np.uint32) << 16).view(np.float32) if kv_type == "bf16" else (
        bits.view(np.float16).astype(np.float32))
    storage = np.zeros((bits.size + 1) // 2, dtype=np.float32)
    storage.view(np.uint16)[:bits.size] = bits
    return storage, wide


REDUCED_CASES = ("decode-head-major", "prefill-causal-gqa", "decode-mqa-token-major",
                 "prefill-causal-alibi", "decode-alibi")


@pytest.mark.parametrize("kv_type", ["f16", "bf16"])
@pytest.mark.parametrize("case", REDUCED_CASES)
@pytest.mark.parametrize("cls", ATTENTION, ids=lambda c: c.name)
def test_peer_reads_a_reduced_kv_type(cls: type[Peer], case: str, kv_type: str) -> None:
    """K and V stored in f16 or bf16, q rounded to the type as mha_bench gives it: the peers
    with a form for the type match attention in double on the stored values within the fp32
    bound plus what their arithmetic in the type may cost (bench/peers.h, peer_bound: the
    weights rounded to the type, then the output; |v| <= 1 here)."""
    peer = loaded(cls)
    assert isinstance(peer, Peer)
    p = replace(make_problem(**CASES[case]), kv_type=kv_type)
    why = peer.why_unsupported(p)
    if why is not None:
        assert kv_type not in cls.kv_types or why == cls().why_unsupported(
            replace(p, kv_type="f32")), why
        pytest.skip(why)
    rng = np.random.default_rng(11)
    q, k, v, o = buffers(p, rng, copies=2)
    q = [rounded(x, kv_type)[1] for x in q]
    stored = {n: [rounded(x, kv_type) for x in xs] for n, xs in (("k", k), ("v", v))}
    t = Tensors.from_buffers(p, q, [s for s, _ in stored["k"]], [s for s, _ in stored["v"]], o)
    call = peer.prepare(p, t, threads=1)
    for c in (0,) if cls is OpenVinoSdpaKvCache and p.q_len == 1 else (1, 0):
        call(c)
    peer.write_output(p, t)
    f32 = replace(p, kv_type="f32")
    wide = Tensors.from_buffers(f32, q, [w for _, w in stored["k"]], [w for _, w in stored["v"]],
                                o.copy())
    want = attention(f32, wide.q[0], wide.k[0], wide.v[0])
    u = 2.0 ** -11 if kv_type == "f16" else 2.0 ** -8
    bound = error_bound(p) + 2 * u / (1 - u) + u
    err = np.abs(t.o - want).max()
    assert err <= bound, f"{peer.name} on {case} in {kv_type}: max |error| {err:.3g} > {bound:.3g}"


def stored_i8(p: Problem, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ([batch, length, heads, dim] float32 view) as i8 rows, a scale per row (max |x| /
    127, as the project's cache stores them): the bytes in a float32 buffer with p.k_strides'
    element positions, the scales [batch, kv_len, kv_heads] token-major, and the values
    (q s) in float32."""
    scale = (np.abs(x).max(axis=-1, keepdims=True) / 127).astype(np.float32)
    q8 = np.rint(x / np.where(scale == 0, 1, scale)).clip(-127, 127).astype(np.int8)
    storage = np.zeros((extent(p, p.kv_len, p.kv_heads, p.k_strides) + 3) // 4, np.float32)
    view(storage, p.batch, p.kv_len, p.kv_heads, p.head_dim, p.k_strides, np.int8)[...] = q8
    return storage, np.ascontiguousarray(scale).reshape(-1), q8.astype(np.float32) * scale


@pytest.mark.parametrize("case", ["decode-head-major", "decode-mqa-token-major"])
def test_openvino_reads_an_i8_cache_within_its_requantization_bound(case: str) -> None:
    """peer-openvino-sdpa-kvcache on an i8 cache (its u8 form, quantized again from the stored
    values with scales and zero points of its own) matches attention in double on the stored
    values within the fp32 bound plus what that requantization may move (bench/peers.h,
    peer_bound): each element by delta = 1.125 steps of range / 255 plus 2^-24 max |x|, a logit
    by e = scale |q|_1 delta_K, the output by (e^(2e) - 1) max |v| + delta_V."""
    peer = loaded(OpenVinoSdpaKvCache)
    assert isinstance(peer, Peer)
    base = make_problem(**CASES[case])
    dense = (base.kv_len * base.kv_heads, base.kv_heads, 1)
    p = replace(base, kv_type="i8", k_scale_strides=dense, v_scale_strides=dense)
    assert peer.why_unsupported(p) is None
    assert "decode only" in peer.why_unsupported(replace(p, q_len=p.kv_len))
    rng = np.random.default_rng(13)
    q, k, v, o = buffers(p, rng, copies=1)
    f32 = replace(p, kv_type="f32", k_scale_strides=None, v_scale_strides=None)
    raw = Tensors.from_buffers(f32, q, k, v, o)
    (ks, kscale, kw), (vs, vscale, vw) = stored_i8(p, raw.k[0]), stored_i8(p, raw.v[0])
    t = Tensors.from_buffers(p, q, [ks], [vs], o, [kscale], [vscale])
    call = peer.prepare(p, t, threads=1)
    call(0)
    peer.write_output(p, t)
    wide_k, wide_v = k[0].copy(), v[0].copy()
    wide = Tensors.from_buffers(f32, q, [wide_k], [wide_v], o.copy())
    wide.k[0][...] = kw
    wide.v[0][...] = vw
    want = attention(f32, wide.q[0], wide.k[0], wide.v[0])

    def move(x: np.ndarray) -> float:
        return 1.125 * float(x.max() - x.min()) / 255 + 2.0 ** -24 * float(np.abs(x).max())

    logit = p.scale * np.abs(wide.q[0]).sum(axis=-1).max() * move(kw)
    bound = error_bound(p) + math.expm1(2 * logit) * float(np.abs(vw).max()) + move(vw)
    err = np.abs(t.o - want).max()
    assert err <= bound, f"{peer.name} on {case} in i8: max |error| {err:.3g} > {bound:.3g}"
    print(f"{case}: max |error| {err:.3g}, bound {bound:.3g}, max |o| {np.abs(want).max():.3g}")


@pytest.mark.parametrize("kind", ["prefill", "prefill-causal", "decode", "decode-gqa",
                                  "decode-mqa", "prefill-gqa-token-major", "decode-f16",
                                  "decode-gqa-bf16", "decode-gqa-i8", "prefill-gqa-alibi"])
def test_openvino_kv_cache_keeps_the_fused_node(kind: str) -> None:
    """The CPU plugin compiles peer-openvino-sdpa-kvcache's model for every kind of problem
    with its ScaledDotProductAttention node, not a MatMul, Softmax, MatMul decomposition or
    a Snippets subgraph (the plain opset13 model gets those); with an f16, bf16 or u8 (i8)
    cache too, and with ALiBi's float mask."""
    peer = loaded(OpenVinoSdpaKvCache)
    assert isinstance(peer, OpenVinoSdpaKvCache)
    heads, kv_heads = {"decode-gqa": (8, 2), "decode-mqa": (8, 1), "decode-gqa-bf16": (8, 2),
                       "decode-gqa-i8": (8, 2), "prefill-gqa-token-major": (8, 2),
                       "prefill-gqa-alibi": (8, 2)}.get(kind, (4, 4))
    q_len = 1 if kind.startswith("decode") else 64
    p = make_problem(1, q_len, 64 if q_len > 1 else 256, heads, kv_heads, 32,
                     causal=kind != "prefill", kv_head_major=kind != "prefill-gqa-token-major",
                     alibi=alibi_slopes(heads) if kind.endswith("alibi") else None)
    for kv_type in ("f16", "bf16", "i8"):
        if kind.endswith(kv_type):
            p = replace(p, kv_type=kv_type)
    head_major = kind != "prefill-gqa-token-major"
    types = peer.runtime_layer_types(p, head_major, head_major)
    assert "ScaledDotProductAttention" in types, sorted(types)
    assert not types & {"MatMul", "Softmax", "Subgraph"}, sorted(types)


def test_openvino_kv_cache_decode_sets_its_cache_back() -> None:
    """peer-openvino-sdpa-kvcache's decode steps append their key to the cache; every
    2 sqrt(Lk) calls the cache is set back, so the call after that many is exact again."""
    peer = loaded(OpenVinoSdpaKvCache)
    assert isinstance(peer, Peer)
    p = make_problem(1, 1, 100, 4, 2, 16, causal=True, kv_head_major=True)
    q, k, v, o = buffers(p, np.random.default_rng(3), copies=1)
    t = Tensors.from_buffers(p, q, k, v, o)
    call = peer.prepare(p, t, threads=1)
    want = attention(p, t.q[0], t.k[0], t.v[0])
    period = int(2 * math.sqrt(p.kv_len))
    for n in range(1, 2 * period + 2):
        call(0)
        peer.write_output(p, t)
        err = np.abs(t.o - want).max()
        exact = n % period == 1 or period == 1
        assert (err <= error_bound(p)) == exact, f"call {n}: max |error| {err:.3g}"


def test_mask_kinds_follow_bottom_right_alignment() -> None:
    assert make_problem(1, 4, 4, 1, 1, 8, causal=False).mask is Mask.NONE
    assert make_problem(1, 1, 9, 1, 1, 8, causal=True).mask is Mask.NONE
    assert make_problem(1, 4, 4, 1, 1, 8, causal=True).mask is Mask.CAUSAL
    p = make_problem(1, 2, 5, 1, 1, 8, causal=True)
    assert p.mask is Mask.EXPLICIT
    assert p.visible().tolist() == [[True, True, True, True, False], [True] * 5]
    assert make_problem(1, 5, 2, 1, 1, 8, causal=True).why_unsupported() is not None


def test_dense_strides() -> None:
    assert dense_token_major(10, 4, 8) == (320, 32, 8)
    assert dense_head_major(10, 4, 8) == (320, 8, 80)


def memfd(values: np.ndarray) -> tuple[int, str]:
    fd = os.memfd_create("mha-test")
    os.write(fd, values.astype(np.float32).tobytes())
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


def test_server_protocol_end_to_end() -> None:
    """Greeting, supports, prepare (output written to the shared o), run, release; errors
    are replies, not crashes."""
    class Reference(Peer):  # a peer computed with numpy: tests the server, not a framework
        name = "peer-numpy"
        package = "numpy"

        def prepare(self, p, t, threads):
            self.t = t
            return lambda c: setattr(self, "out", attention(p, t.q[0], t.k[c], t.v[c]))

        def write_output(self, p, t):
            t.o[...] = self.out

    p = make_problem(1, 3, 6, 2, 1, 4, causal=True)
    rng = np.random.default_rng(1)
    q, k, v, o = buffers(p, rng)
    fds, paths = zip(*(memfd(x) for x in (q[0], k[0], v[0], o)))
    try:
        fields = (f"batch=1 q_len=3 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 "
                  f"scale={p.scale!r} q_strides=8,8,4 k_strides=4,4,4 v_strides=4,4,4 "
                  f"o_strides=8,8,4")
        server = Server([Reference()])
        assert server.handle(f"supports peer-numpy {fields}") == "yes"
        reply = server.handle(f"prepare peer-numpy {fields} threads=1 q={paths[0]} k={paths[1]} "
                              f"v={paths[2]} o={paths[3]}")
        assert reply.startswith("ok "), reply
        shared = np.frombuffer(mmap.mmap(fds[3], o.nbytes), dtype=np.float32)
        want = attention(p, *(t[0] for t in (
            Tensors.from_buffers(p, q, k, v, o).q, Tensors.from_buffers(p, q, k, v, o).k,
            Tensors.from_buffers(p, q, k, v, o).v)))
        assert np.abs(shared.reshape(1, 3, 2, 4) - want).max() < 1e-6
        assert server.handle("run 3").startswith("ok ")
        assert server.handle("release") == "ok"
        assert server.handle("run 1") == "error run before prepare"
        assert server.handle("prepare peer-none x=1").startswith("error unknown peer")
        assert server.handle("frobnicate").startswith("error unknown request")
    finally:
        for fd in fds:
            os.close(fd)


def test_reduced_kv_types_are_parsed_and_refused() -> None:
    """kv_type (and i8's scale strides) reach the problem; a peer whose form does not read
    the type answers no, naming it, and a prepare of it is an error."""
    base = ("batch=1 q_len=1 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 scale=0.5 "
            "q_strides=8,8,4 k_strides=24,4,24 v_strides=24,4,24 o_strides=8,8,4")
    fields = dict(w.split("=") for w in base.split())
    assert Problem.parse(fields).kv_type == "f32"
    i8 = Problem.parse({**fields, "kv_type": "i8", "k_scale_strides": "6,1,6",
                        "v_scale_strides": "6,1,6"})
    assert i8.kv_type == "i8" and i8.k_scale_strides == (6, 1, 6)
    with pytest.raises(ValueError, match="kv_type 'f64'"):
        Problem.parse({**fields, "kv_type": "f64"})
    server = Server([cls() for cls in ATTENTION])
    i8_fields = f"{base} kv_type=i8 k_scale_strides=6,1,6 v_scale_strides=6,1,6"
    refused = 0
    for name, peer in server.peers.items():
        assert isinstance(peer, Peer)
        for kv_type, fields in (("bf16", f"{base} kv_type=bf16"), ("i8", i8_fields)):
            if kv_type in peer.kv_types:
                continue
            reply = server.handle(f"supports {name} {fields}")
            assert reply.startswith("no ") and kv_type in reply, (name, reply)
            assert server.handle(f"prepare {name} {fields} threads=1").startswith(
                "error unsupported"), name
            refused += 1
    assert refused >= len(server.peers)  # none reads i8 yet


def test_softcap_is_parsed_and_refused() -> None:
    """softcap reaches the problem, absent, 0 and +inf being none (as mha::soft_capped); a
    capped problem is answered yes by the peers whose operator caps and no, naming it, by the
    others, whose prepare of it is an error; an uncapped one is every peer's."""
    base = ("batch=1 q_len=1 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 scale=0.5 "
            "q_strides=8,8,4 k_strides=24,4,24 v_strides=24,4,24 o_strides=8,8,4")
    fields = dict(w.split("=") for w in base.split())
    assert Problem.parse(fields).softcap == 0.0
    for none in ("0", "inf"):
        p = Problem.parse({**fields, "softcap": none})
        assert not p.soft_capped and p.capped(np.array([7.0])) == 7.0, none
    p = Problem.parse({**fields, "softcap": "50"})
    assert p.softcap == 50.0 and p.soft_capped
    assert np.allclose(p.capped(np.array([1e6, -1e6, 0.0])), [50.0, -50.0, 0.0])
    server = Server([cls() for cls in ATTENTION])
    capping = set()
    for name, peer in server.peers.items():
        assert isinstance(peer, Peer)
        for none in ("", " softcap=0", " softcap=inf"):
            assert server.handle(f"supports {name} {base}{none}") == "yes", (name, none)
        reply = server.handle(f"supports {name} {base} softcap=50")
        if peer.softcap:
            assert reply == "yes", (name, reply)
            capping.add(name)
            continue
        assert reply == f"no logit soft-capping: {name} takes none", reply
        assert server.handle(f"prepare {name} {base} softcap=50 threads=1") == (
            f"error unsupported: logit soft-capping: {name} takes none"), name
    assert capping == {"peer-ort-attention", "peer-ort-attention-grouped", "peer-ort-gqa"}


def test_reference_caps_the_logits_not_the_sinks() -> None:
    """The float64 reference the peers are checked against: with a cap, the softmax of
    c tanh(s / c) over the keys and the sink as given, written out here for one row."""
    p = make_problem(1, 1, 5, 1, 1, 4, causal=True, sinks=(1.5,), softcap=1.0, logits=15.0)
    q, k, v, o = buffers(p, np.random.default_rng(2))
    t = Tensors.from_buffers(p, q, k, v, o)
    s = p.scale * (t.k[0][0, :, 0].astype(np.float64) @ t.q[0][0, 0, 0].astype(np.float64))
    assert np.abs(s).max() > 2  # the cap matters
    w = np.exp(np.append(np.tanh(s), 1.5))
    want = (w[:-1] / w.sum()) @ t.v[0][0, :, 0].astype(np.float64)
    got = attention(p, t.q[0], t.k[0], t.v[0])[0, 0, 0]
    assert np.abs(got - want).max() < 1e-12


def test_alibi_is_parsed_and_refused() -> None:
    """alibi (one slope per query head) and alibi_offset (absent: 0) reach the problem; a
    problem with ALiBi is answered yes by the peers whose operator adds it (OpenVINO's KV-cache
    form in prefill only) and no, naming it, by a peer without, whose prepare of it is an
    error; one without is every peer's."""
    decode = ("batch=1 q_len=1 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 scale=0.5 "
              "q_strides=8,8,4 k_strides=24,4,24 v_strides=24,4,24 o_strides=8,8,4")
    prefill = ("batch=1 q_len=6 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 scale=0.5 "
               "q_strides=48,8,4 k_strides=24,4,24 v_strides=24,4,24 o_strides=48,8,4")
    fields = dict(w.split("=") for w in decode.split())
    p = Problem.parse(fields)
    assert p.alibi is None and p.alibi_offset == 0 and not p.has_alibi and p.mask is Mask.NONE
    slopes = "0.0625,0.00390625"
    p = Problem.parse({**fields, "alibi": slopes, "alibi_offset": "-3"})
    assert p.alibi == (0.0625, 2.0 ** -8) and p.alibi_offset == -3 and p.has_alibi
    assert p.mask is Mask.BIAS
    # Row 0 of 1 at position 0 + 6 - 1 - 3 = 2: head h's bias -m_h |2 - j| for keys 0..5.
    distance = np.abs(2 - np.arange(6))
    assert np.array_equal(p.alibi_bias(), -np.array([0.0625, 2.0 ** -8])[None, :, None, None]
                          * distance)
    # 17 significant digits give a float32 slope back exactly.
    assert Problem.parse({**fields, "alibi": "0.70710676908493042,0.5"}).alibi[0] == float(
        np.float32(2.0 ** -0.5))

    class Unbiased(Peer):  # a peer without ALiBi: its refusal (every framework peer has it)
        name = "peer-unbiased"
        package = "numpy"

    server = Server([cls() for cls in ATTENTION] + [Unbiased()])
    biasing = set()
    for name, peer in server.peers.items():
        assert isinstance(peer, Peer)
        for line in (decode, prefill):
            if server.handle(f"supports {name} {line}") != "yes":
                assert name.endswith("-grouped") and line == prefill, name
                continue
            reply = server.handle(f"supports {name} {line} alibi={slopes} alibi_offset=2")
            if peer.alibi and (line == prefill or not isinstance(peer, OpenVinoSdpaKvCache)):
                assert reply == "yes", (name, reply)
                biasing.add(name)
                continue
            if peer.alibi:
                assert reply.startswith("no ALiBi in decode"), (name, reply)
                continue
            assert reply == f"no ALiBi: {name} takes no bias", reply
            assert server.handle(f"prepare {name} {line} alibi={slopes} threads=1") == (
                f"error unsupported: ALiBi: {name} takes no bias"), name
    assert biasing == {cls.name for cls in ATTENTION}


def test_reference_biases_after_the_cap_not_the_sinks() -> None:
    """The float64 reference the peers are checked against, with ALiBi, a soft-cap and sinks
    on a ragged batch of GQA heads with q_len < kv_len and an offset: the softmax of
    c tanh(s / c) - m_h |i + n - q_len + offset - j| over the keys j <= i + n - q_len of the
    sequence's n, and the sink as given, written out here row by row."""
    slopes = (0.75, 0.5, 0.25, 0.125)
    sinks = (1.5, -0.5, 0.25, 2.0)
    p = make_problem(2, 3, 8, 4, 2, 4, causal=True, kv_lens=(5, 8), sinks=sinks, softcap=1.0,
                     logits=15.0, alibi=slopes, alibi_offset=-2)
    q, k, v, o = buffers(p, np.random.default_rng(2))
    t = Tensors.from_buffers(p, q, k, v, o)
    got = attention(p, t.q[0], t.k[0], t.v[0])
    f64 = np.float64
    for b, n in enumerate((5, 8)):
        for h in range(4):
            for i in range(3):
                logits, values = [], []
                for j in range(i + n - 3 + 1):
                    s = p.scale * float(t.k[0][b, j, h // 2].astype(f64)
                                        @ t.q[0][b, i, h].astype(f64))
                    logits.append(math.tanh(s) - slopes[h] * abs(i + n - 3 - 2 - j))
                    values.append(t.v[0][b, j, h // 2].astype(f64))
                w = np.exp(np.append(logits, sinks[h]))
                want = (w[:-1] / w.sum()) @ np.array(values)
                assert np.abs(got[b, i, h] - want).max() < 1e-12, (b, h, i)


def variant(cls: type[Problem], p: Problem) -> Problem:
    """p with its ALiBi added as cls adds it (one of the wrong ways below)."""
    return cls(**vars(p))


@dataclass(frozen=True)
class NoBias(Problem):
    """ALiBi left out."""

    def logits(self, s: np.ndarray) -> np.ndarray:
        return self.capped(s)


@dataclass(frozen=True)
class WrongSign(Problem):
    """+m_h |distance|: the far keys favoured."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        return -Problem.alibi_bias(self, dtype)


@dataclass(frozen=True)
class TopLeft(Problem):
    """Row i at position i + offset (top-left, as is_causal aligns), not i + n - q_len +
    offset."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        return Problem.alibi_bias(replace(self, kv_lens=None, alibi_offset=self.alibi_offset
                                          - (self.kv_len - self.q_len)), dtype)


@dataclass(frozen=True)
class CapacityPositions(Problem):
    """Every sequence of a ragged batch placed on the capacity kv_len, not its own length."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        return Problem.alibi_bias(replace(self, kv_lens=None), dtype)


@dataclass(frozen=True)
class OffsetIgnored(Problem):
    """alibi_offset taken as 0."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        return Problem.alibi_bias(replace(self, alibi_offset=0), dtype)


@dataclass(frozen=True)
class OneSided(Problem):
    """The signed distance i + n - q_len + offset - j, no absolute value: keys after the row's
    position favoured (a causal-only shortcut)."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        bias = Problem.alibi_bias(self, dtype)
        lens = self.kv_lens if self.kv_lens is not None else (self.kv_len,)
        rows, cols = np.arange(self.q_len)[:, None], np.arange(self.kv_len)[None, :]
        after = np.stack([cols > rows + n - self.q_len + self.alibi_offset for n in lens])
        return np.where(after[:, None], -bias, bias)


@dataclass(frozen=True)
class PerKvHead(Problem):
    """Query head h given the slope alibi[h / g], indexed by its KV head."""

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        assert self.alibi is not None
        return Problem.alibi_bias(replace(self, alibi=tuple(
            self.alibi[h // self.group] for h in range(self.q_heads))), dtype)


@dataclass(frozen=True)
class BiasBeforeCap(Problem):
    """c tanh((s + bias) / c): the bias capped with the logit."""

    def logits(self, s: np.ndarray) -> np.ndarray:
        return self.capped(s + self.alibi_bias())


# The ways to get ALiBi wrong.
WRONG_ALIBI: dict[str, type[Problem]] = {
    "no bias": NoBias, "wrong sign": WrongSign, "top-left positions": TopLeft,
    "positions on the capacity": CapacityPositions, "offset ignored": OffsetIgnored,
    "one-sided distance": OneSided, "slopes per KV head": PerKvHead,
    "bias before the cap": BiasBeforeCap,
}


def changes_the_weights(p: Problem, wrong: Problem) -> bool:
    """Whether `wrong` moves some row's logits by more than a constant over the keys the row
    sees: the softmax is blind to a constant (a causal row's position shifted while every key
    it sees stays before it leaves o as it is, and no peer's answer can tell). The logits from
    s = 0, which shows each wrong way here, the bias before the cap included."""
    zero = np.zeros((p.batch, p.q_heads, p.q_len, p.kv_len))
    moved = np.broadcast_to(wrong.logits(zero) - p.logits(zero), zero.shape)
    visible = np.broadcast_to(p.sequences_visible(), zero.shape)
    spread = (np.where(visible, moved, -np.inf).max(axis=-1)
              + np.where(visible, -moved, -np.inf).max(axis=-1))
    return bool(spread.max() > 1e-9)


ALIBI_CASES = sorted(c for c in CASES if CASES[c].get("alibi") is not None)


@pytest.mark.parametrize("wrong", sorted(WRONG_ALIBI))
def test_alibi_cases_tell_the_wrong_alibis_apart(wrong: str) -> None:
    """On the peer test's ALiBi cases, with its inputs, the reference for each wrong way to add
    ALiBi differs from the right one by more than 100 times the bound a peer is held to, in
    every case where it changes the weights (and there is one): a peer computing it fails."""
    told = 0
    for case in ALIBI_CASES:
        whole = make_problem(**CASES[case])
        other_problem = variant(WRONG_ALIBI[wrong], whole)
        if not changes_the_weights(whole, other_problem):
            continue
        q, k, v, o = buffers(whole, np.random.default_rng(7), copies=2)
        t = Tensors.from_buffers(whole, q, k, v, o)
        right = attention(whole, t.q[0], t.k[0], t.v[0])
        other = attention(other_problem, t.q[0], t.k[0], t.v[0])
        gap, bound = np.abs(other - right).max(), error_bound(whole.sliced())
        assert gap > 100 * bound, f"{wrong} on {case}: {gap:.3g}, bound {bound:.3g}"
        told += 1
    assert told > 0, wrong


def test_greeting_ends_with_ready() -> None:
    out = io.StringIO()
    serve(io.StringIO(""), out)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "ready"
    assert all(line.split()[0] in ("peer", "skip", "how") for line in lines[:-1])
    assert sum(line.split()[0] in ("peer", "skip") for line in lines) == len(ALL)
    hows = [line.split()[1] for line in lines if line.startswith("how ")]
    peers = [line.split()[1] for line in lines if line.startswith("peer ")]
    assert hows == peers  # every loaded peer says how it is run, after its peer line


# --- GEMM and layer peers ----------------------------------------------------------------

U = 2.0 ** -24  # fp32 unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma(n) = n u / (1 - n u): the relative bound of n roundings."""
    return n * U / (1 - n * U)


GEMM_CASES = {
    "square": Gemm(m=64, n=64, k=64),
    "odd": Gemm(m=37, n=53, k=129),
    "row": Gemm(m=1, n=96, k=300),  # a decoded token's projection
    "tall": Gemm(m=200, n=8, k=17),
}


def gemm_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|fl(A B) - A B| <= gamma(k) |A| |B|, elementwise, for a sum of k products in any order
    and blocking, fused or not (Higham, Accuracy and Stability, section 3.1). The float64
    reference's own error, about 1e-16 |A| |B|, is far below it."""
    return gamma(a.shape[1]) * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))


def gemm_tensors(s: Gemm, rng: np.random.Generator) -> GemmTensors:
    return GemmTensors(a=rng.uniform(-1, 1, (s.m, s.k)).astype(np.float32),
                       b=rng.uniform(-1, 1, (s.k, s.n)).astype(np.float32),
                       c=np.full((s.m, s.n), np.nan, dtype=np.float32))


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_torch_matmul_matches_product_in_double(case: str) -> None:
    peer = loaded(TorchMatmul)
    assert isinstance(peer, TorchMatmul)
    s = GEMM_CASES[case]
    t = gemm_tensors(s, np.random.default_rng(3))
    call = peer.prepare(s, t, threads=1)
    call(0)
    peer.write_output(s, t)
    exact = t.a.astype(np.float64) @ t.b.astype(np.float64)
    err = np.abs(t.c - exact)
    assert (err <= gemm_bound(t.a, t.b)).all(), f"{case}: max |error| {err.max():.3g}"


LAYER_CASES = {
    "prefill-causal": Layer(batch=1, d=48, heads=4, kv_heads=4, head_dim=12, n=19, past=0,
                            causal=True, bias=False),
    "prefill-bias": Layer(batch=2, d=32, heads=2, kv_heads=2, head_dim=16, n=11, past=0,
                          causal=False, bias=True),
    "prefill-causal-gqa": Layer(batch=2, d=64, heads=8, kv_heads=2, head_dim=8, n=23, past=0,
                                causal=True, bias=True),
    "prefill-mqa": Layer(batch=1, d=24, heads=3, kv_heads=1, head_dim=16, n=9, past=0,
                         causal=False, bias=False),
    "decode-gqa": Layer(batch=2, d=64, heads=4, kv_heads=2, head_dim=16, n=1, past=40,
                        causal=True, bias=True),
    "decode-mha": Layer(batch=1, d=32, heads=4, kv_heads=4, head_dim=8, n=1, past=13,
                        causal=True, bias=False),
    "chunk-causal": Layer(batch=1, d=32, heads=4, kv_heads=2, head_dim=8, n=6, past=10,
                          causal=True, bias=True),  # bottom-right through a boolean mask
    "chunk": Layer(batch=1, d=32, heads=2, kv_heads=1, head_dim=16, n=5, past=7,
                   causal=False, bias=False),
}


def layer_tensors(s: Layer, rng: np.random.Generator) -> LayerTensors:
    """x in [-1, 1]; weights in [-1, 1] / sqrt(in) (nn.Linear's initialisation), so that
    every projection is of order 1; biases in [-1/2, 1/2]; the past cache in [-1, 1]."""
    hd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.uniform(-1, 1, shape)).astype(np.float32)

    def bias(n: int) -> np.ndarray | None:
        return rand(n, scale=0.5) if s.bias else None

    cache = (s.batch, s.kv_heads, s.capacity, s.head_dim)
    return LayerTensors(
        x=rand(s.batch, s.n, s.d), wq=rand(s.d, hd, scale=s.d ** -0.5),
        wk=rand(s.d, kvd, scale=s.d ** -0.5), wv=rand(s.d, kvd, scale=s.d ** -0.5),
        wo=rand(hd, s.d, scale=hd ** -0.5), bq=bias(hd), bk=bias(kvd), bv=bias(kvd),
        bo=bias(s.d), k_cache=rand(*cache), v_cache=rand(*cache),
        y=np.full((s.batch, s.n, s.d), np.nan, dtype=np.float32))


def layer_bound(s: Layer, t: LayerTensors, r: LayerReference) -> np.ndarray:
    """A worst-case bound on |y - exact y|, elementwise, for any correct fp32 composition
    (the argument of reference/layer.h, with the attention step bounded as error_bound does
    above, for inputs of any size):

    1. Projections: a GEMM over d products plus the bias, |Q^ - Q| <= eQ = gamma(d + 1)
       (|x| |W^Q| + |b^Q|); eK and eV likewise for the new rows, 0 for the past rows (copied).
    2. The attention of (Q^, K^, V^) against that of (Q, K, V): a logit moves by at most
       sigma = scale max_t sum_e (eQ |K| + |Q| eK + eQ eK), every softmax weight by a factor
       within exp(+-2 sigma), so the weights by min(2, exp(2 sigma) - 1) in sum, and the
       output by that times V' plus max eV, V' = max (|V| + eV).
    3. The framework's attention on (Q^, K^, V^): error_bound's terms, its logit error
       gamma(D + 3) A' (D products, the scale's rounding and the two of a scale split over q
       and k, as PyTorch's math path does), A' = scale max_t sum_e (|Q| + eQ)(|K| + eK),
       scaled by V'. So eO = that + step 2, per row and head.
    4. W^O: |y^ - y| <= gamma(H D + 1) ((|O| + eO) |W^O| + |b^O|) + eO |W^O|.
    Maxima are taken per (sequence, head, row) over all keys, which only loosens the bound."""
    f64 = np.float64
    b, n, h, hkv, dim = s.batch, s.n, s.heads, s.kv_heads, s.head_dim
    g, scale, length = h // hkv, 1 / math.sqrt(dim), s.capacity

    def projection_error(w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        mag = np.abs(t.x).astype(f64) @ np.abs(w).astype(f64)
        return gamma(s.d + 1) * (mag if bias is None else mag + np.abs(bias))

    def heads_first(x: np.ndarray, count: int) -> np.ndarray:
        return x.reshape(b, n, count, dim).transpose(0, 2, 1, 3)

    def cache_error(w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        e = np.zeros((b, hkv, length, dim))
        e[:, :, s.past:] = heads_first(projection_error(w, bias), hkv)
        return np.repeat(e, g, axis=1)  # per query head

    e_q = heads_first(projection_error(t.wq, t.bq), h)  # [B, H, n, D]
    e_k, e_v = cache_error(t.wk, t.bk), cache_error(t.wv, t.bv)  # [B, H, L, D]
    q, k, v = np.abs(r.q), np.abs(np.repeat(r.k, g, axis=1)), np.abs(np.repeat(r.v, g, axis=1))
    visible = s.attention.visible()

    def row_max(x: np.ndarray) -> np.ndarray:  # [B, H, n, L] -> [B, H, n], visible keys
        return np.where(visible, x, 0.0).max(axis=-1)

    def kt(x: np.ndarray) -> np.ndarray:  # keys' transpose, [B, H, D, L]
        return x.transpose(0, 1, 3, 2)

    sigma = scale * row_max(e_q @ kt(k) + q @ kt(e_k) + e_q @ kt(e_k))
    big_a = scale * row_max((q + e_q) @ kt(k + e_k))
    v_max = (v + e_v).max(axis=(2, 3))[:, :, None]  # [B, H, 1]
    ev_max = e_v.max(axis=(2, 3))[:, :, None]
    e_s = gamma(dim + 3) * big_a
    e_w = 2 * e_s + 17 * U + 3 * U * length
    attention = (2 * e_w + (2 * length + 1) * U) * v_max
    moved = np.minimum(2.0, np.expm1(2 * sigma)) * v_max + ev_max
    e_o = np.repeat((attention + moved).transpose(0, 2, 1), dim, axis=2)  # [B, n, H D]
    wo = np.abs(t.wo).astype(f64)
    bo = 0.0 if t.bo is None else np.abs(t.bo).astype(f64)
    return gamma(h * dim + 1) * ((np.abs(r.o) + e_o) @ wo + bo) + e_o @ wo


def check_layer(s: Layer, t: LayerTensors, y: np.ndarray, what: str) -> None:
    r = layer(s, t)
    tol = layer_bound(s, t, r)
    # A worst case, about 1000 times the errors seen, yet below 1e-3 of y: a wrong mask,
    # cache position, head or bias moves y by 1e-2 of its size and more, so fails.
    assert tol.max() < 1e-3 * np.abs(r.y).max(), f"{what}: bound {tol.max():.3g} too loose"
    err = np.abs(y - r.y)
    assert (err <= tol).all(), f"{what}: max |error| {err.max():.3g}, bound {tol.max():.3g}"


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_torch_layer_matches_layer_in_double(case: str) -> None:
    peer = loaded(TorchLayer)
    assert isinstance(peer, TorchLayer)
    s = LAYER_CASES[case]
    t = layer_tensors(s, np.random.default_rng(11))
    call = peer.prepare(s, t, threads=1)
    call(0)
    peer.write_output(s, t)
    check_layer(s, t, t.y, case)


@pytest.mark.parametrize("case", ["decode-gqa", "chunk-causal", "prefill-causal-gqa"])
def test_torch_layer_calls_are_identical_steps(case: str) -> None:
    """Every call writes the same cache positions, so a second call gives the same y, bit
    for bit, and mha_bench's own cache buffers are never written."""
    peer = loaded(TorchLayer)
    assert isinstance(peer, TorchLayer)
    s = LAYER_CASES[case]
    t = layer_tensors(s, np.random.default_rng(5))
    k_cache, v_cache = t.k_cache.copy(), t.v_cache.copy()
    call = peer.prepare(s, t, threads=2)
    ys = []
    for _ in range(3):
        call(0)
        peer.write_output(s, t)
        ys.append(t.y.copy())
    assert all(np.array_equal(y, ys[0]) for y in ys[1:])
    assert np.array_equal(t.k_cache, k_cache) and np.array_equal(t.v_cache, v_cache)
    check_layer(s, t, ys[0], case)


def shared(arrays: dict[str, np.ndarray]) -> tuple[list[int], dict[str, str]]:
    """Each array in a memfd file, as mha_bench shares its tensors: fds and paths."""
    fds, paths = [], {}
    for name, x in arrays.items():
        fd, path = memfd(x)
        fds.append(fd)
        paths[name] = path
    return fds, paths


def read_shared(path: str, shape: tuple[int, ...]) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.float32)[:math.prod(shape)].reshape(shape)


def test_server_gemm_requests() -> None:
    """supports_gemm, prepare_gemm (C written in the shared file), run, release."""
    server = Server([loaded(TorchMatmul)])
    s = GEMM_CASES["odd"]
    t = gemm_tensors(s, np.random.default_rng(2))
    fds, paths = shared({"a": t.a, "b": t.b, "c": t.c})
    try:
        shape = f"m={s.m} n={s.n} k={s.k}"
        assert server.handle(f"supports_gemm peer-torch-matmul {shape}") == "yes"
        assert server.handle("supports_gemm peer-torch-matmul m=0 n=1 k=1").startswith("no ")
        reply = server.handle(f"prepare_gemm peer-torch-matmul {shape} threads=1 "
                              f"a={paths['a']} b={paths['b']} c={paths['c']}")
        assert reply.startswith("ok "), reply
        c = read_shared(paths["c"], (s.m, s.n))
        exact = t.a.astype(np.float64) @ t.b.astype(np.float64)
        assert (np.abs(c - exact) <= gemm_bound(t.a, t.b)).all()
        assert server.handle("run 5").startswith("ok ")
        assert server.handle("release") == "ok"
        # cold=: a flush before each timed call; the same output, a time for the calls alone
        reply = server.handle(f"prepare_gemm peer-torch-matmul {shape} threads=1 cold=65536 "
                              f"a={paths['a']} b={paths['b']} c={paths['c']}")
        assert reply.startswith("ok "), reply
        assert server.flush is not None and server.flush.nbytes == 65536
        assert float(server.handle("run 3").split()[1]) > 0
        assert (read_shared(paths["c"], (s.m, s.n)) == c).all()
        assert server.handle("release") == "ok"
        assert server.handle(f"prepare_gemm peer-torch-matmul {shape} threads=1 "
                             f"a={paths['a']} b={paths['b']}").startswith("error ")
        assert server.flush is None
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("case", ["decode-gqa", "prefill-causal"])
def test_server_layer_requests(case: str) -> None:
    """supports_layer, prepare_layer (y written in the shared file, the caches untouched),
    run, release; a missing tensor is an error reply."""
    server = Server([loaded(TorchLayer)])
    s = LAYER_CASES[case]
    t = layer_tensors(s, np.random.default_rng(4))
    arrays = {n: getattr(t, n) for n in ("x", "wq", "wk", "wv", "wo", "k_cache", "v_cache", "y")}
    if s.bias:
        arrays.update({n: getattr(t, n) for n in ("bq", "bk", "bv", "bo")})
    if s.past == 0:
        del arrays["k_cache"], arrays["v_cache"]  # optional without past tokens
    fds, paths = shared(arrays)
    try:
        shape = (f"batch={s.batch} d={s.d} heads={s.heads} kv_heads={s.kv_heads} "
                 f"head_dim={s.head_dim} n={s.n} past={s.past} causal={int(s.causal)} "
                 f"bias={int(s.bias)}")
        tensors = " ".join(f"{n}={p}" for n, p in paths.items())
        assert server.handle(f"supports_layer peer-torch-layer {shape}") == "yes"
        reply = server.handle(f"prepare_layer peer-torch-layer {shape} threads=1 {tensors}")
        assert reply.startswith("ok "), reply
        y = read_shared(paths["y"], t.y.shape)
        check_layer(s, t, y, case)
        assert server.handle("run 3").startswith("ok ")
        assert np.array_equal(read_shared(paths["y"], t.y.shape), y)  # run leaves y alone
        if s.past > 0:
            assert np.array_equal(read_shared(paths["k_cache"], t.k_cache.shape), t.k_cache)
            assert np.array_equal(read_shared(paths["v_cache"], t.v_cache.shape), t.v_cache)
        assert server.handle("release") == "ok"
        no_wq = " ".join(f"{n}={p}" for n, p in paths.items() if n != "wq")
        reply = server.handle(f"prepare_layer peer-torch-layer {shape} threads=1 {no_wq}")
        assert reply == "error unknown peer or missing field 'wq'", reply
        assert server.handle("run 1") == "error run before prepare"
    finally:
        for fd in fds:
            os.close(fd)


ATTENTION_FIELDS = ("batch=1 q_len=3 kv_len=6 q_heads=2 kv_heads=1 head_dim=4 causal=1 "
                    "scale=0.5 q_strides=8,8,4 k_strides=4,4,4 v_strides=4,4,4 o_strides=8,8,4")
GEMM_FIELDS = "m=4 n=5 k=6"
LAYER_FIELDS = "batch=1 d=8 heads=2 kv_heads=1 head_dim=4 n=3 past=2 causal=1 bias=0"


def test_peers_answer_only_their_own_kind() -> None:
    """An attention peer answers no to GEMM and layer problems, and the GEMM and layer peers
    no to every kind but theirs; prepare on the wrong kind is an error. (Kind is decided by
    the server before the framework is touched: no framework needed.)"""
    server = Server([TorchSdpa(), TorchMatmul(), TorchLayer()])
    requests = {"attention": ("supports", ATTENTION_FIELDS), "gemm": ("supports_gemm",
                GEMM_FIELDS), "layer": ("supports_layer", LAYER_FIELDS)}
    for peer in ("peer-torch-sdpa", "peer-torch-matmul", "peer-torch-layer"):
        kind = server.peers[peer].kind
        for problem, (op, fields) in requests.items():
            reply = server.handle(f"{op} {peer} {fields}")
            if problem == kind:
                assert reply == "yes", (peer, op, reply)
            else:
                assert reply == f"no {peer} computes {kind} problems, not {problem}", reply
    reply = server.handle(f"prepare_layer peer-torch-sdpa {LAYER_FIELDS} threads=1")
    assert reply == "error unsupported: peer-torch-sdpa computes attention problems, not layer"
    bad = LAYER_FIELDS.replace("kv_heads=1", "kv_heads=3")
    assert server.handle(f"supports_layer peer-torch-layer {bad}").startswith(
        "no kv_heads=3 does not divide")


def planted_bench_run(plant: str, benchmark_filter: str, kv_type: str = "f32"
                      ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """mha_bench --plant=<plant> with the peer server on the benchmarks the filter selects
    (the build's mha_bench, or $MHA_BENCH), and the installed peers whose form reads kv_type;
    skips without either."""
    repo = Path(__file__).resolve().parents[3]
    bench = Path(os.environ.get("MHA_BENCH", repo / "build" / "bench" / "mha_bench"))
    if not bench.is_file():
        pytest.skip(f"no mha_bench at {bench} (scripts/test.sh native builds it)")
    installed = []
    for cls in ATTENTION:
        try:
            cls().load()
        except ImportError:
            continue
        installed += [cls.name] if kv_type in cls.kv_types else []
    if not installed:
        pytest.skip(f"no framework with a {kv_type} form installed")
    command = f"env PYTHONPATH={repo / 'bench' / 'peers'} {sys.executable} -m mha_peers"
    run = subprocess.run([str(bench), f"--plant={plant}", f"--peers={command}",
                          f"--benchmark_filter={benchmark_filter}"],
                         capture_output=True, text=True, timeout=600)
    return run, installed


def test_bench_check_rejects_a_peer_returning_zeros() -> None:
    """mha_bench --plant=zeros replaces each peer's answer by zeros before its output check
    on a 131072-key decode: the check must reject it for every installed peer."""
    run, installed = planted_bench_run(
        "zeros", "^decode/peer-.*/H:8/Hkv:1/Lq:1/Lk:131072/.*threads:1/")
    assert run.returncode == 0, run.stderr[-2000:]
    rejected = run.stdout.count("planted answer rejected")
    assert rejected >= len(installed), run.stdout[-2000:]  # each once, GQA only where causal
    assert "not rejected" not in run.stderr


@pytest.mark.parametrize("plant, kv_types", [("middle-key", "f16|bf16"), ("zeros", "i8")])
def test_bench_check_rejects_a_reduced_precision_peer(plant: str, kv_types: str) -> None:
    """On f16 and bf16 caches the check allows a peer's arithmetic in the type, on i8 its own
    8-bit copy of K and V (bench/peers.h, peer_bound); it must still reject a peer that drops
    each row's dominant key (f16, bf16: mha_bench --plant=middle-key), or whose answer is
    zeros (i8, whose bound is wide enough on these inputs that a dropped dominant key passes
    it: peers.h says so), at 32768 and 131072 keys."""
    run, installed = planted_bench_run(
        plant, "^decode/peer-.*/H:8/Hkv:(1|8)/Lq:1/Lk:(131072|32768)/.*"
        f"/kv:({kv_types})/threads:1/", kv_type=kv_types.split("|")[0])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("planted answer rejected") >= 2 * len(installed), run.stdout[-2000:]
    assert "not rejected" not in run.stderr

"""Each framework peer against attention in float64 on small problems of every kind the
benchmarks time and a few they do not (bottom-right causal with q_len < kv_len, padded
strides), and the server's protocol end to end. Framework tests skip when the framework is
not installed (the report's environment has none of them)."""

from __future__ import annotations

import io
import math
import mmap
import os

import numpy as np
import pytest

from mha_peers.frameworks import ALL, Peer
from mha_peers.problem import (Mask, Problem, Tensors, dense_head_major, dense_token_major,
                               attention)
from mha_peers.server import Server, serve


def make_problem(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int,
                 causal: bool, kv_head_major: bool = False, pad: int = 0) -> Problem:
    """Token-major q and o; k and v token- or head-major; `pad` floats after every row."""
    def strides(length: int, h: int, head_major: bool) -> tuple[int, int, int]:
        row = dim + pad
        if head_major:
            return (h * length * row, row, length * row)
        return (length * h * row, h * row, row)

    return Problem(batch, q_len, kv_len, heads, kv_heads, dim, causal, 1 / math.sqrt(dim),
                   strides(q_len, heads, False), strides(kv_len, kv_heads, kv_head_major),
                   strides(kv_len, kv_heads, kv_head_major), strides(q_len, heads, False))


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
    """|o - exact| for inputs in [-1, 1], u = 2^-24: logits err by e_s = (D + 1) sqrt(D) u
    (the fp32 dot product and the scaling); each weight exp(s - max) relatively by 2 e_s,
    u for the subtraction, 16 u for an exp within 8 ulp (the peers' bound in bench/main.cpp)
    and 3 u per key for an online softmax that rescales at every key (the worst blocking);
    the output by twice the weights' error plus the two sums of n terms and the division."""
    u = 2.0 ** -24
    e_s = (p.head_dim + 1) * math.sqrt(p.head_dim) * u
    e_w = 2 * e_s + 17 * u + 3 * u * p.kv_len
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
}


def loaded(cls: type[Peer]) -> Peer:
    peer = cls()
    try:
        peer.load()
    except ImportError as e:
        pytest.skip(f"{peer.name}: {e}")
    return peer


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_peer_matches_attention_in_double(cls: type[Peer], case: str) -> None:
    peer = loaded(cls)
    p = make_problem(**CASES[case])
    why = peer.why_unsupported(p)
    if why is not None:
        assert cls.name == "peer-ort-gqa" and not p.causal  # the only peer that declines
        pytest.skip(why)
    rng = np.random.default_rng(7)
    q, k, v, o = buffers(p, rng, copies=2)
    t = Tensors.from_buffers(p, q, k, v, o)
    call = peer.prepare(p, t, threads=1)
    for c in (1, 0):  # the last call, on copy 0, is the one written out
        call(c)
    peer.write_output(p, t)
    want = attention(p, t.q[0], t.k[0], t.v[0])
    err = np.abs(t.o - want).max()
    assert err <= error_bound(p), f"{peer.name} on {case}: max |error| {err:.3g}"


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


def test_greeting_ends_with_ready() -> None:
    out = io.StringIO()
    serve(io.StringIO(""), out)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "ready"
    assert all(line.split()[0] in ("peer", "skip") for line in lines[:-1])
    assert len(lines) - 1 == len(ALL)

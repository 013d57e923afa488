"""The two problems beside attention that mha_bench times peers on: one GEMM, and the whole
multi-head attention layer (mha/layer.h), as mha_bench describes them (bench/peers.h), with
their tensors as numpy views of the shared buffers and float64 references for the tests.

Every tensor is fp32, dense and row-major, one copy each:

* GEMM: C[m][n] = A[m][k] B[k][n].
* Layer, with model width d, H query heads and Hkv KV heads of width D, g = H / Hkv, batch
  B, n new tokens and ``past`` tokens already in the cache (capacity = past + n):
  x [B][n][d]; the weights in the math layout [in][out]: wq [d][H D], wk and wv [d][Hkv D],
  wo [H D][d]; optional biases bq [H D], bk and bv [Hkv D], bo [d]; the KV cache, head-major
  k_cache and v_cache [B][Hkv][capacity][D], whose first ``past`` positions hold the past
  tokens' K and V; the output y [B][n][d]. Q = x W^Q + b^Q (K, V likewise), the n new K and
  V rows go to cache positions [past, past + n), the n queries attend over all past + n
  keys with scale 1 / sqrt(D) (causal: bottom-right, query i sees keys j <= past + i), and
  y = Concat(heads) W^O + b^O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import Problem, dense_head_major, dense_token_major


def dense(buffer: np.ndarray, *shape: int) -> np.ndarray:
    """The C-contiguous view of the first prod(shape) floats of a flat float32 buffer (a
    shared mapping holds whole pages, so usually more)."""
    count = math.prod(shape)
    if count > buffer.size:
        raise ValueError(f"tensor {list(shape)} needs {count} floats, its buffer holds "
                         f"{buffer.size}")
    return buffer[:count].reshape(shape)


def _positive(**sizes: int) -> str | None:
    bad = [f"{name}={value}" for name, value in sizes.items() if value <= 0]
    return f"sizes must be positive: {' '.join(bad)}" if bad else None


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int

    def why_unsupported(self) -> str | None:
        return _positive(m=self.m, n=self.n, k=self.k)

    @staticmethod
    def parse(fields: dict[str, str]) -> "Gemm":
        return Gemm(m=int(fields["m"]), n=int(fields["n"]), k=int(fields["k"]))


@dataclass
class GemmTensors:
    a: np.ndarray  # [m][k]
    b: np.ndarray  # [k][n]
    c: np.ndarray  # [m][n], written

    @staticmethod
    def from_buffers(s: Gemm, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> "GemmTensors":
        return GemmTensors(a=dense(a, s.m, s.k), b=dense(b, s.k, s.n), c=dense(c, s.m, s.n))


@dataclass(frozen=True)
class Layer:
    batch: int
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    n: int
    past: int
    causal: bool
    bias: bool

    @property
    def capacity(self) -> int:
        """Cache positions per sequence: the past tokens and the new ones."""
        return self.past + self.n

    @property
    def attention(self) -> Problem:
        """The attention step as an attention problem: the n new queries (token-major) over
        the past + n keys of the head-major cache, bottom-right causal, scale 1 / sqrt(D);
        its ``mask`` says how a framework must be told which keys a query sees."""
        h, hkv, dim, cap = self.heads, self.kv_heads, self.head_dim, self.capacity
        return Problem(self.batch, self.n, cap, h, hkv, dim, self.causal, 1 / math.sqrt(dim),
                       dense_token_major(self.n, h, dim), dense_head_major(cap, hkv, dim),
                       dense_head_major(cap, hkv, dim), dense_token_major(self.n, h, dim))

    def why_unsupported(self) -> str | None:
        why = _positive(batch=self.batch, d=self.d, heads=self.heads, kv_heads=self.kv_heads,
                        head_dim=self.head_dim, n=self.n)
        if why is not None:
            return why
        if self.past < 0:
            return f"past={self.past} is negative"
        if self.heads % self.kv_heads != 0:
            return f"kv_heads={self.kv_heads} does not divide heads={self.heads}"
        return None

    @staticmethod
    def parse(fields: dict[str, str]) -> "Layer":
        return Layer(
            batch=int(fields["batch"]),
            d=int(fields["d"]),
            heads=int(fields["heads"]),
            kv_heads=int(fields["kv_heads"]),
            head_dim=int(fields["head_dim"]),
            n=int(fields["n"]),
            past=int(fields["past"]),
            causal=fields["causal"] == "1",
            bias=fields["bias"] == "1",
        )


@dataclass
class LayerTensors:
    """The layer's tensors as dense views; biases None without bias, the caches None when
    past = 0 and mha_bench sent none (nothing to read from them then)."""

    x: np.ndarray  # [B][n][d]
    wq: np.ndarray  # [d][H D]
    wk: np.ndarray  # [d][Hkv D]
    wv: np.ndarray  # [d][Hkv D]
    wo: np.ndarray  # [H D][d]
    bq: np.ndarray | None  # [H D]
    bk: np.ndarray | None  # [Hkv D]
    bv: np.ndarray | None  # [Hkv D]
    bo: np.ndarray | None  # [d]
    k_cache: np.ndarray | None  # [B][Hkv][capacity][D], read only
    v_cache: np.ndarray | None
    y: np.ndarray  # [B][n][d], written

    @staticmethod
    def from_buffers(s: Layer, b: dict[str, np.ndarray]) -> "LayerTensors":
        """Views of the buffers named by the prepare_layer fields (x, wq, ..., y)."""
        hd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        cache = (s.batch, s.kv_heads, s.capacity, s.head_dim)

        def optional(name: str, *shape: int) -> np.ndarray | None:
            return dense(b[name], *shape) if name in b else None

        if s.past > 0 and ("k_cache" not in b or "v_cache" not in b):
            raise ValueError(f"past={s.past} needs k_cache and v_cache")
        if s.bias and any(n not in b for n in ("bq", "bk", "bv", "bo")):
            raise ValueError("bias=1 needs bq, bk, bv and bo")
        return LayerTensors(
            x=dense(b["x"], s.batch, s.n, s.d),
            wq=dense(b["wq"], s.d, hd),
            wk=dense(b["wk"], s.d, kvd),
            wv=dense(b["wv"], s.d, kvd),
            wo=dense(b["wo"], hd, s.d),
            bq=optional("bq", hd) if s.bias else None,
            bk=optional("bk", kvd) if s.bias else None,
            bv=optional("bv", kvd) if s.bias else None,
            bo=optional("bo", s.d) if s.bias else None,
            k_cache=optional("k_cache", *cache),
            v_cache=optional("v_cache", *cache),
            y=dense(b["y"], s.batch, s.n, s.d),
        )


@dataclass
class LayerReference:
    """The layer in float64 (for the tests): y, and the exact intermediates the tests' error
    bound is made of. Shapes: q [B][H][n][D]; k, v [B][Hkv][capacity][D] (the given past
    rows, then the new ones); o [B][n][H D]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    y: np.ndarray


def layer(s: Layer, t: LayerTensors) -> LayerReference:
    """The layer in float64 straight from the formula, sharing nothing with the peers."""
    b, n, h, hkv, dim = s.batch, s.n, s.heads, s.kv_heads, s.head_dim

    def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        out = x.astype(np.float64) @ w.astype(np.float64)
        return out if bias is None else out + bias.astype(np.float64)

    def heads_first(x: np.ndarray, count: int) -> np.ndarray:
        return x.reshape(b, n, count, dim).transpose(0, 2, 1, 3)

    def cache(c: np.ndarray | None, new: np.ndarray) -> np.ndarray:
        full = np.zeros((b, hkv, s.capacity, dim))
        if c is not None:
            full[:, :, :s.past] = c[:, :, :s.past]
        full[:, :, s.past:] = heads_first(new, hkv)
        return full

    q = heads_first(linear(t.x, t.wq, t.bq), h)
    k = cache(t.k_cache, linear(t.x, t.wk, t.bk))
    v = cache(t.v_cache, linear(t.x, t.wv, t.bv))
    g = h // hkv
    kh, vh = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    logits = (q @ kh.transpose(0, 1, 3, 2)) / math.sqrt(dim)
    logits = np.where(s.attention.visible(), logits, -np.inf)
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))  # every row sees key 0
    w /= w.sum(axis=-1, keepdims=True)
    o = (w @ vh).transpose(0, 2, 1, 3).reshape(b, n, h * dim)
    return LayerReference(q=q, k=k, v=v, o=o, y=linear(o, t.wo, t.bo))

"""One attention problem as mha_bench describes it, and its tensors as numpy views.

The fields and their meaning are those of ``mha::Problem`` (kernels/include/mha/attention.h):
element strides ``(batch, seq, head)`` for q, k, v and o, the head_dim axis contiguous, and
causal masking aligned bottom-right (query ``i`` sees keys ``j <= i + kv_len - q_len``). A
ragged batch (``kv_lens``) gives each sequence ``b`` its own first ``kv_lens[b]`` keys, the
causal rule bottom-right on that length; ``kv_len`` is the tensors' capacity. Attention sinks
(``sinks``, one logit per query head) join each head's softmax denominator only. A sliding
window (``window``, 0 none) keeps the ``window`` most recent of the keys a row sees. Logit
soft-capping (``softcap`` = c, 0 or +inf none) turns every logit s = scale q.k into
c tanh(s / c) before the softmax; the sinks are not capped. ALiBi (``alibi``, one slope m_h per
query head, and ``alibi_offset``) adds -m_h |i + kv_len - q_len + alibi_offset - j| to the logit
of row i and key j after the cap (kv_len: each sequence's own in a ragged batch, so the row's
position is bottom-right as the causal rule's); the sinks get no bias.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

Strides = tuple[int, int, int]

_FLOAT = np.dtype(np.float32).itemsize

# The element types K and V may be stored in (mha::KvType's names).
KV_TYPES = ("f32", "f16", "bf16", "i8")


class Mask(Enum):
    """How a framework must be told which keys a query row sees (and, with ALiBi, what their
    logits get added)."""

    NONE = "none"  # every row sees every key: no mask at all
    CAUSAL = "causal"  # the usual lower triangle (q_len == kv_len): the framework's own flag
    EXPLICIT = "explicit"  # bottom-right causal with 1 < q_len != kv_len: a boolean mask
    RAGGED = "ragged"  # each sequence its own keys (kv_lens): a boolean mask per sequence
    # ALiBi (alibi), with any of the above: an additive float mask, [B or 1, H, Lq, Lk], the
    # bias where a row sees a key and -inf where it does not (Problem.additive_mask).
    BIAS = "bias"


@dataclass(frozen=True)
class Problem:
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    scale: float
    q_strides: Strides
    k_strides: Strides
    v_strides: Strides
    o_strides: Strides
    # K and V as stored (kernels/include/mha/kv_types.h): f32, f16, bf16, or i8 with an fp32
    # scale per (token, KV head) row, whose strides are k_scale_strides and v_scale_strides.
    kv_type: str = "f32"
    k_scale_strides: Strides | None = None
    v_scale_strides: Strides | None = None
    # A ragged batch: each sequence's keys (mha::Problem::kv_lens), or None.
    kv_lens: tuple[int, ...] | None = None
    # Attention sinks: one logit per query head (mha::Problem::sinks), or None.
    sinks: tuple[float, ...] | None = None
    # A sliding window: the most keys a row sees (mha::Problem::window), 0 for none.
    window: int = 0
    # Logit soft-capping (mha::Problem::softcap): the cap c, 0 (or +inf) for none.
    softcap: float = 0.0
    # ALiBi (mha::Problem::alibi): one slope per query head, or None; the distances' offset
    # (mha::Problem::alibi_offset).
    alibi: tuple[float, ...] | None = None
    alibi_offset: int = 0

    @property
    def soft_capped(self) -> bool:
        """Whether the logits are capped (mha::soft_capped: softcap finite and positive)."""
        return 0.0 < self.softcap < math.inf

    def capped(self, s: np.ndarray) -> np.ndarray:
        """The logits s as the softmax takes them: c tanh(s / c) when soft-capped, else s."""
        if not self.soft_capped:
            return s
        return self.softcap * np.tanh(s / self.softcap)

    @property
    def has_alibi(self) -> bool:
        """Whether the logits get ALiBi's biases (mha::has_alibi: slopes given)."""
        return self.alibi is not None

    def alibi_bias(self, dtype: type = np.float64) -> np.ndarray:
        """[B or 1, H, Lq, Lk], what ALiBi adds to the logit of row i and key j of head h:
        -alibi[h] |i + n - q_len + alibi_offset - j|, n the sequence's keys (kv_lens[b] in a
        ragged batch, whose sequences each have their own row; else kv_len, one for all), for
        every key, seen or not; zeros without ALiBi. Computed in float64 (exact for an fp32
        slope and a distance below 2^29) and rounded once to dtype."""
        lens = self.kv_lens if self.kv_lens is not None else (self.kv_len,)
        slopes = self.alibi if self.alibi is not None else (0.0,) * self.q_heads
        rows = np.arange(self.q_len)[:, None]
        cols = np.arange(self.kv_len)[None, :]
        out = np.empty((len(lens), self.q_heads, self.q_len, self.kv_len), dtype=dtype)
        for b, n in enumerate(lens):
            distance = np.abs(rows + (n - self.q_len + self.alibi_offset) - cols)
            for h, m in enumerate(slopes):  # a head at a time: float64 temporaries of [Lq, Lk]
                out[b, h] = -m * distance
        return out

    def logits(self, s: np.ndarray) -> np.ndarray:
        """The logits the softmax takes from the scaled products s = scale q.k ([B, H, Lq,
        Lk]): capped, then ALiBi's bias added."""
        s = self.capped(s)
        return s + self.alibi_bias() if self.has_alibi else s

    def additive_mask(self) -> np.ndarray:
        """[B or 1, H, Lq, Lk] float32, the mask of Mask.BIAS: ALiBi's bias where a row sees the
        key (its own sequence's keys, causal, the window), -inf where it does not."""
        visible = self.sequences_visible() if self.kv_lens is not None else self.visible()
        mask = self.alibi_bias(np.float32)
        np.copyto(mask, -np.inf, where=~visible)
        return mask

    @property
    def group(self) -> int:
        """Query heads per KV head (g = H / Hkv)."""
        return self.q_heads // self.kv_heads

    @property
    def mask(self) -> Mask:
        if self.has_alibi:
            return Mask.BIAS
        if self.kv_lens is not None:
            return Mask.RAGGED
        if 0 < self.window < self.kv_len:
            return Mask.EXPLICIT  # the window cuts some row's keys
        if not self.causal or self.q_len == 1:
            return Mask.NONE  # a single query row sees the whole cache, bottom-right
        if self.q_len == self.kv_len:
            return Mask.CAUSAL  # top-left and bottom-right agree
        return Mask.EXPLICIT

    @property
    def grouped_decode(self) -> bool:
        """One query row per head (q_len 1, which sees every key) and g > 1 query heads per
        KV head: a step whose g query heads the grouped peers fold into g query rows."""
        return self.q_len == 1 and self.kv_heads < self.q_heads

    def visible(self) -> np.ndarray:
        """[q_len, kv_len] booleans: True where query row i sees key j."""
        return self.visible_of(self.kv_len)

    def visible_of(self, keys: int) -> np.ndarray:
        """[q_len, kv_len] booleans for a sequence of `keys` keys: key j < keys, bottom-right
        causal on that length, within the window's most recent."""
        rows = np.arange(self.q_len)[:, None]
        cols = np.arange(self.kv_len)[None, :]
        end = np.minimum(rows + 1 + (keys - self.q_len), keys) if self.causal else keys
        first = end - self.window if self.window > 0 else 0
        return (cols < end) & (cols >= first)

    def sequences_visible(self) -> np.ndarray:
        """[batch, 1, q_len, kv_len] booleans: True where query row i of sequence b sees key
        j (its own kv_lens[b] keys, bottom-right causal on them, within the window); kv_lens
        None: every sequence alike."""
        lens = self.kv_lens if self.kv_lens is not None else (self.kv_len,) * self.batch
        out = np.empty((self.batch, 1, self.q_len, self.kv_len), dtype=bool)
        for b, n in enumerate(lens):
            out[b, 0] = self.visible_of(n)
        return out

    @property
    def window_start(self) -> int | None:
        """The first key of a window every row shares, when it cuts the keys: one query row
        (or none causal) and no per-sequence lengths. Such a problem is the one over keys
        [window_start, kv_len) without a window (Tensors.sliced), which is how a user calls a
        framework for it: with no mask and only the window's keys read."""
        if not 0 < self.window < self.kv_len or self.kv_lens is not None:
            return None
        if self.causal and self.q_len > 1:
            return None
        return self.kv_len - self.window

    def why_unsupported(self) -> str | None:
        """Why no framework can compute this problem as the project defines it, or None."""
        if self.causal and self.q_len > self.kv_len:
            return "causal with q_len > kv_len: rows that see no key are zeros here, NaN there"
        if self.kv_lens is not None and (
                min(self.kv_lens) < 1 or (self.causal and min(self.kv_lens) < self.q_len)):
            return "a sequence whose rows see no key: zeros here, NaN there"
        return None

    @staticmethod
    def parse(fields: dict[str, str]) -> "Problem":
        def strides(name: str) -> Strides:
            b, s, h = (int(x) for x in fields[f"{name}_strides"].split(","))
            return (b, s, h)

        kv_type = fields.get("kv_type", "f32")
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type '{kv_type}' is none of {', '.join(KV_TYPES)}")
        i8 = kv_type == "i8"

        return Problem(
            batch=int(fields["batch"]),
            q_len=int(fields["q_len"]),
            kv_len=int(fields["kv_len"]),
            q_heads=int(fields["q_heads"]),
            kv_heads=int(fields["kv_heads"]),
            head_dim=int(fields["head_dim"]),
            causal=fields["causal"] == "1",
            scale=float(fields["scale"]),
            q_strides=strides("q"),
            k_strides=strides("k"),
            v_strides=strides("v"),
            o_strides=strides("o"),
            kv_type=kv_type,
            k_scale_strides=strides("k_scale") if i8 else None,
            v_scale_strides=strides("v_scale") if i8 else None,
            kv_lens=(tuple(int(x) for x in fields["kv_lens"].split(","))
                     if "kv_lens" in fields else None),
            sinks=(tuple(float(x) for x in fields["sinks"].split(","))
                   if "sinks" in fields else None),
            window=int(fields.get("window", "0")),
            softcap=float(fields.get("softcap", "0")),
            alibi=(tuple(float(x) for x in fields["alibi"].split(","))
                   if "alibi" in fields else None),
            alibi_offset=int(fields.get("alibi_offset", "0")),
        )

    def sliced(self) -> "Problem":
        """A problem whose window every row shares (window_start) as the problem over the
        window's keys alone, without a window."""
        start = self.window_start
        if start is None:
            return self
        return replace(self, kv_len=self.kv_len - start, window=0)


def dense_token_major(length: int, heads: int, dim: int) -> Strides:
    """Strides of a dense [batch, length, heads, dim] tensor."""
    return (length * heads * dim, heads * dim, dim)


def dense_head_major(length: int, heads: int, dim: int) -> Strides:
    """Strides of a dense [batch, heads, length, dim] tensor."""
    return (heads * length * dim, dim, length * dim)


# The numpy dtype a KV type's elements are read as: bf16, which numpy lacks, as its 16 bits
# (uint16; torch views them as bfloat16), i8 as int8 (its scales are float32).
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i8": np.int8}


def view(buffer: np.ndarray, batch: int, length: int, heads: int, dim: int, strides: Strides,
         dtype: type = np.float32) -> np.ndarray:
    """The [batch, length, heads, dim] view of a flat buffer (float32 storage) holding
    elements of `dtype`, with strides in those elements."""
    flat = buffer.view(dtype)
    item = flat.itemsize
    b, s, h = strides
    extent = (batch - 1) * b + (length - 1) * s + (heads - 1) * h + dim
    if extent > flat.size:
        raise ValueError(f"tensor needs {extent} elements, its buffer holds {flat.size}")
    return np.lib.stride_tricks.as_strided(
        flat, shape=(batch, length, heads, dim),
        strides=(b * item, s * item, h * item, item), writeable=buffer.flags.writeable)


class SharedBuffers:
    """Maps the memfd files mha_bench names (/proc/<pid>/fd/<n>), each once."""

    def __init__(self) -> None:
        self._maps: dict[str, np.ndarray] = {}

    def get(self, path: str) -> np.ndarray:
        if path not in self._maps:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE)
            self._maps[path] = np.frombuffer(m, dtype=np.float32)
        return self._maps[path]

    def clear(self) -> None:
        self._maps.clear()


@dataclass
class Tensors:
    """The problem's tensors as [batch, length, heads, dim] views: q, o and one k, v per copy."""

    q: list[np.ndarray]
    k: list[np.ndarray]
    v: list[np.ndarray]
    o: np.ndarray

    # i8's per-row scales, [batch, kv_len, kv_heads, 1] views, one per copy (else empty).
    k_scale: list[np.ndarray] = field(default_factory=list)
    v_scale: list[np.ndarray] = field(default_factory=list)

    @staticmethod
    def from_buffers(p: Problem, q: list[np.ndarray], k: list[np.ndarray], v: list[np.ndarray],
                     o: np.ndarray, k_scale: list[np.ndarray] | None = None,
                     v_scale: list[np.ndarray] | None = None) -> "Tensors":
        """K and V (and i8's scales, required then) as p.kv_type stores them."""
        kv = KV_DTYPES[p.kv_type]
        scales: dict[str, list[np.ndarray]] = {"k": [], "v": []}
        if p.kv_type == "i8":
            if not k_scale or not v_scale:
                raise ValueError("kv_type i8 needs k_scale and v_scale")
            scales = {
                "k": [view(b, p.batch, p.kv_len, p.kv_heads, 1, p.k_scale_strides)
                      for b in k_scale],
                "v": [view(b, p.batch, p.kv_len, p.kv_heads, 1, p.v_scale_strides)
                      for b in v_scale]}
        return Tensors(
            q=[view(b, p.batch, p.q_len, p.q_heads, p.head_dim, p.q_strides) for b in q],
            k=[view(b, p.batch, p.kv_len, p.kv_heads, p.head_dim, p.k_strides, kv) for b in k],
            v=[view(b, p.batch, p.kv_len, p.kv_heads, p.head_dim, p.v_strides, kv) for b in v],
            o=view(o, p.batch, p.q_len, p.q_heads, p.head_dim, p.o_strides),
            k_scale=scales["k"], v_scale=scales["v"],
        )

    def widened(self, p: Problem, name: str, c: int) -> np.ndarray:
        """Copy c of k or v (`name`) in float32: the stored values exactly (f16 and bf16
        widen exactly; i8 as q s, rounded once, as a kernel forms it)."""
        x = getattr(self, name)[c]
        if p.kv_type == "bf16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        if p.kv_type == "i8":
            return x.astype(np.float32) * getattr(self, f"{name}_scale")[c]
        return x.astype(np.float32)

    @property
    def copies(self) -> int:
        return len(self.k)

    def sliced(self, p: Problem) -> "Tensors":
        """The tensors of p.sliced(): K and V (and i8's scales) from key p.window_start on,
        views of the same memory."""
        start = p.window_start
        if start is None:
            return self
        return replace(self, k=[x[:, start:] for x in self.k], v=[x[:, start:] for x in self.v],
                       k_scale=[x[:, start:] for x in self.k_scale],
                       v_scale=[x[:, start:] for x in self.v_scale])


def as_token_major(x: np.ndarray) -> np.ndarray:
    """x ([B, L, H, D] view) as a C-contiguous [B, L, H, D] array: the same memory when it
    is laid out so, else a copy."""
    return np.ascontiguousarray(x)


def as_head_major(x: np.ndarray) -> np.ndarray:
    """x ([B, L, H, D] view) as a C-contiguous [B, H, L, D] array: the same memory when it
    is laid out so (or L == 1, where both layouts coincide), else a copy."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def is_head_major(x: np.ndarray) -> bool:
    """Whether the [B, L, H, D] view x is a dense head-major tensor."""
    return x.transpose(0, 2, 1, 3).flags.c_contiguous


def attention(p: Problem, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Attention in float64 straight from the formula, [B, Lq, H, D]: for the tests."""
    g = p.group
    qh = q.transpose(0, 2, 1, 3).astype(np.float64)
    kh = np.repeat(k.transpose(0, 2, 1, 3), g, axis=1).astype(np.float64)
    vh = np.repeat(v.transpose(0, 2, 1, 3), g, axis=1).astype(np.float64)
    s = p.logits(p.scale * (qh @ kh.transpose(0, 1, 3, 2)))  # capped, biased, then masked
    s = np.where(p.sequences_visible(), s, -np.inf)
    sink = (np.array(p.sinks, dtype=np.float64)[None, :, None, None] if p.sinks is not None
            else np.full((1, p.q_heads, 1, 1), -np.inf))
    m = np.maximum(s.max(axis=-1, keepdims=True), sink)
    w = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    w /= w.sum(axis=-1, keepdims=True) + np.exp(sink - np.where(np.isfinite(m), m, 0.0))
    return (w @ vh).transpose(0, 2, 1, 3)

"""The framework peers: what a user would call instead of an mha kernel, each given its best
honest call on the problem.

Every peer reads the problem's own tensors in place where its API accepts them as they lie
(dense token-major or head-major buffers, as mha_bench gives them); only layouts a framework
cannot take (padded or broadcast strides, which the benchmarks never use) are copied, once,
when the peer is prepared. A call computes the peer's output in its own layout; ``prepare``
copies the first call's output into the problem's o tensor for mha_bench to check, and the
timed calls leave it where the framework put it.

A peer serves one kind of problem (``Framework.kind``): attention (``Peer``, the requests
supports and prepare), a GEMM (``GemmPeer``, supports_gemm and prepare_gemm) or the whole
layer (``LayerPeer``, supports_layer and prepare_layer); run and release serve every kind.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np

from .layer import Gemm, GemmTensors, Layer, LayerTensors
from .problem import Mask, Problem, Tensors, as_head_major, as_token_major, is_head_major

Call = Callable[[int], None]  # runs the peer once on copy c


class Framework:
    """One framework operator. Subclasses set ``name``, ``package`` and ``kind``."""

    name = ""
    package = ""
    kind = ""  # the problems it computes: "attention", "gemm" or "layer"
    # How it is run, for the report's table of peers: layout, form, mask, fused path.
    how = ""

    def version(self) -> str:
        return f"{self.package}-{importlib.metadata.version(self.package)}"

    def load(self) -> None:
        """Imports the framework; raises ImportError (or any error) when it cannot."""


class Peer(Framework):
    """An attention operator."""

    kind = "attention"
    # The KV types (Problem.kv_type) the peer's form reads; a peer is absent from the rows of
    # the others.
    kv_types: tuple[str, ...] = ("f32",)
    # Whether its form takes a ragged batch (Problem.kv_lens: each sequence its own keys),
    # attention sinks (Problem.sinks) and a sliding window that cuts some row's keys
    # (Problem.window; one every row shares comes sliced off by the server: Problem.sliced),
    # logit soft-capping (Problem.softcap: c tanh(s / c) of each scaled logit, the sinks
    # not capped) and ALiBi (Problem.alibi: -m_h |i + kv_len - q_len + offset - j| added to
    # each logit after the cap, the sinks not biased).
    ragged = False
    sinks = False
    window = False
    softcap = False
    alibi = False

    def why_unsupported(self, p: Problem) -> str | None:
        if p.kv_type not in self.kv_types:
            return f"K and V in {p.kv_type}: {self.name} reads {', '.join(self.kv_types)} only"
        if p.kv_lens is not None and not self.ragged:
            return f"sequences of their own lengths: {self.name} takes no per-sequence lengths"
        if p.sinks is not None and not self.sinks:
            return f"attention sinks: {self.name} takes none"
        if 0 < p.window < p.kv_len and not self.window:
            return f"a sliding window: {self.name} takes none"
        if p.soft_capped and not self.softcap:
            return f"logit soft-capping: {self.name} takes none"
        if p.has_alibi and not self.alibi:
            return f"ALiBi: {self.name} takes no bias"
        return p.why_unsupported()

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        """Builds the peer's session for the problem; returns the call to time."""
        raise NotImplementedError

    def write_output(self, p: Problem, t: Tensors) -> None:
        """Copies the output of the last call into t.o ([B, Lq, H, D])."""
        raise NotImplementedError


class GemmPeer(Framework):
    """A matrix product C = A B."""

    kind = "gemm"

    def why_unsupported(self, s: Gemm) -> str | None:
        return s.why_unsupported()

    def prepare(self, s: Gemm, t: GemmTensors, threads: int) -> Call:
        raise NotImplementedError

    def write_output(self, s: Gemm, t: GemmTensors) -> None:
        """Copies the output of the last call into t.c (nothing to do when calls write it)."""


class LayerPeer(Framework):
    """The whole attention layer, composed as the framework's users compose it."""

    kind = "layer"

    def why_unsupported(self, s: Layer) -> str | None:
        return s.why_unsupported()

    def prepare(self, s: Layer, t: LayerTensors, threads: int) -> Call:
        raise NotImplementedError

    def write_output(self, s: Layer, t: LayerTensors) -> None:
        """Copies the output of the last call into t.y ([B, n, d])."""
        raise NotImplementedError


def load_torch() -> Any:
    """Imports torch, with one inter-op thread (the benchmarks time intra-op threads only)."""
    import torch

    if torch.get_num_interop_threads() != 1:  # settable once, before any parallel work
        torch.set_num_interop_threads(1)
    return torch


class TorchSdpa(Peer):
    """torch.nn.functional.scaled_dot_product_attention on [B, H, L, D] views of the
    tensors (no copy), enable_gqa for Hkv < H; bottom-right causal with q_len != kv_len
    through a boolean mask, since is_causal aligns top-left. K and V in f16 or bf16 are read
    in place as torch.float16 or torch.bfloat16; SDPA takes q in the same type (converted
    once, at prepare: mha_bench gives q rounded to it, so exactly) and returns its output in
    it. SDPA has no soft-cap: a capped problem is not this peer's (flex_attention's score_mod
    could express it, through torch.compile only). ALiBi through a float attn_mask (Mask.BIAS,
    [1, H, Lq, Lk], a ragged batch's [B, H, Lq, Lk]): the bias where a row sees a key, -inf
    where the causal rule, the window or a sequence's length hides it; in fp32 for every KV
    type (the CPU flash kernel, which PyTorch 2.x picks for a float mask as for none, takes an
    fp32 mask beside f16 or bf16 q, so the biases are not rounded to the type)."""

    how = (
        "layout: [B, H, L, D] views, no copy; GQA: enable_gqa; mask: is_causal (Lq = Lk), "
        "else boolean (ragged batches: [B, 1, Lq, Lk], padding masked; sliding windows: "
        "[Lq, Lk]); ALiBi: an fp32 additive mask [1 or B, H, Lq, Lk], the bias and -inf where "
        "masked; f16/bf16 K, V in place, q in their type, output in it; fused path: "
        "PyTorch picks (not checked)")

    name = "peer-torch-sdpa"
    package = "torch"
    kv_types = ("f32", "f16", "bf16")
    ragged = True
    window = True
    alibi = True

    def load(self) -> None:
        self.torch = load_torch()

    def tensors(self, p: Problem, xs: list[np.ndarray], kv: bool) -> list[Any]:
        """[B, L, H, D] arrays as torch tensors of the problem's KV type: K and V (kv) on
        their own memory, q converted."""
        torch = self.torch
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[p.kv_type]
        if not kv:
            return [torch.from_numpy(x).to(dtype) for x in xs]
        out = [torch.from_numpy(x) for x in xs]
        return [x.view(torch.bfloat16) for x in out] if p.kv_type == "bf16" else out

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        torch = self.torch
        torch.set_num_threads(threads)
        heads_first = [[x.permute(0, 2, 1, 3) for x in self.tensors(p, xs, kv)]
                       for xs, kv in ((t.q, False), (t.k, True), (t.v, True))]
        mask = None
        if p.mask is Mask.EXPLICIT:
            mask = torch.from_numpy(p.visible())
        elif p.mask is Mask.RAGGED:
            mask = torch.from_numpy(p.sequences_visible())
        elif p.mask is Mask.BIAS:
            mask = torch.from_numpy(p.additive_mask())
        self.out = None

        def call(c: int) -> None:
            q, k, v = (xs[c % len(xs)] for xs in heads_first)
            with torch.inference_mode():
                self.out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=p.mask is Mask.CAUSAL, scale=p.scale,
                    enable_gqa=p.kv_heads != p.q_heads)

        return call

    def write_output(self, p: Problem, t: Tensors) -> None:
        t.o[...] = self.out.permute(0, 2, 1, 3).float().numpy()


class _Grouped:
    """The folded form of a peer, for grouped-query decode steps only (Problem.grouped_decode):
    mixed in before the plain peer's class, named `plain`, which serves every other problem."""

    plain = ""

    def why_unsupported(self, p: Problem) -> str | None:
        if not p.grouped_decode:
            return f"not a grouped-query decode step (q_len 1, g > 1): see {self.plain}"
        return super().why_unsupported(p)  # type: ignore[misc]


class TorchSdpaGrouped(_Grouped, TorchSdpa):
    """The same operator on a grouped-query decode step as a performance-minded user passes
    it: the g query heads of a KV head are adjacent in a token-major q, so q viewed as
    [B, Hkv, g, D] is g query rows against that KV head's K and V ([B, Hkv, L, D] views, no
    mask, no enable_gqa), and every K and V row is read once per group rather than once per
    query head. Only for one query row per head (q_len = 1, which sees every key) with g > 1:
    other problems are peer-torch-sdpa's. ALiBi: the additive mask of peer-torch-sdpa, its
    query heads folded alike, [1 or B, Hkv, g, Lk] (row r of group k is head k g + r)."""

    how = (
        "folded: q [B, Hkv, g, D] against K, V [B, Hkv, L, D], no mask (ragged batches: "
        "[B, 1, 1, Lk]; ALiBi: fp32 additive [1 or B, Hkv, g, Lk]); grouped-query decode only;"
        " fused path: PyTorch picks (not checked)")

    name = "peer-torch-sdpa-grouped"
    plain = TorchSdpa.name

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        torch = self.torch
        torch.set_num_threads(threads)
        b, hkv, g, d = p.batch, p.kv_heads, p.group, p.head_dim
        # [B, 1, H, D] -> [B, Hkv, g, D]: splits the head axis, a view for any strides.
        q = self.tensors(p, t.q[:1], kv=False)[0].view(b, hkv, g, d)
        kv = [[x.permute(0, 2, 1, 3) for x in self.tensors(p, xs, kv=True)]
              for xs in (t.k, t.v)]
        # A ragged batch: each sequence's padding masked, [B, 1, 1, Lk] over its g rows. ALiBi:
        # [1 or B, H, 1, Lk] -> [1 or B, Hkv, g, Lk], each query head's bias on its own row.
        mask = None
        if p.mask is Mask.RAGGED:
            mask = torch.from_numpy(p.sequences_visible())
        elif p.mask is Mask.BIAS:
            bias = p.additive_mask()
            mask = torch.from_numpy(bias.reshape(bias.shape[0], hkv, g, p.kv_len))
        self.out = None

        def call(c: int) -> None:
            k, v = (xs[c % len(xs)] for xs in kv)
            with torch.inference_mode():
                self.out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=p.scale)

        return call

    def write_output(self, p: Problem, t: Tensors) -> None:
        t.o[...] = self.out.reshape(p.batch, 1, p.q_heads, p.head_dim).float().numpy()


class _Ort(Peer):
    package = "onnxruntime"

    def load(self) -> None:
        import onnx  # noqa: F401  (the models are built with onnx.helper)
        import onnxruntime

        self.ort = onnxruntime

    def version(self) -> str:
        return (f"onnxruntime-{importlib.metadata.version('onnxruntime')}"
                f"+onnx-{importlib.metadata.version('onnx')}")

    def session(self, model: object, threads: int) -> object:
        so = self.ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = self.ort.ExecutionMode.ORT_SEQUENTIAL
        return self.ort.InferenceSession(model.SerializeToString(), so,
                                         providers=["CPUExecutionProvider"])

    def value(self, x: np.ndarray) -> object:
        """An OrtValue on the array's own memory (no copy)."""
        return self.ort.OrtValue.ortvalue_from_numpy(x)


def softcap_attribute(p: Problem) -> dict[str, float]:
    """The softcap attribute of ONNX's Attention and ONNX Runtime's GroupQueryAttention for a
    soft-capped problem (both cap the scaled logit s as c tanh(s / c), the sinks not); none
    for another, whose node then carries no softcap attribute."""
    return dict(softcap=p.softcap) if p.soft_capped else {}


class OrtAttention(_Ort):
    """ONNX's Attention operator (opset 23) in ONNX Runtime's CPU provider: 3D token-major
    inputs [B, L, H*D] for prefill, 4D head-major [B, H, L, D] when the KV cache is
    head-major (decode); q_num_heads/kv_num_heads for GQA; is_causal (top-left) when
    q_len == kv_len, a boolean mask for bottom-right causal or a sliding window otherwise;
    soft-capping through its softcap attribute, which caps the scaled logits before the mask
    (the peer test checks it against the formula). ALiBi through a float attn_mask, which the
    operator adds to the capped logits (Mask.BIAS, [1, H, Lq, Lk]: the bias, -inf where the
    causal rule or the window hides a key; is_causal off)."""

    how = (
        "ONNX Attention (opset 23): 3D token-major (prefill) or 4D head-major (decode); mask:"
        " is_causal (Lq = Lk), else boolean (bottom-right causal, sliding windows); soft-cap:"
        " its softcap attribute; ALiBi: a float attn_mask [1, H, Lq, Lk], the bias and -inf "
        "where masked; fused path: none in the CPU provider (GEMM, softmax, GEMM)")

    name = "peer-ort-attention"
    window = True
    softcap = True
    alibi = True

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        four_d = is_head_major(t.k[0]) or is_head_major(t.v[0])
        if four_d:
            inputs = [[as_head_major(x) for x in xs] for xs in (t.q, t.k, t.v)]
        else:
            inputs = [[as_token_major(x).reshape(x.shape[0], x.shape[1], -1) for x in xs]
                      for xs in (t.q, t.k, t.v)]
        names = ["Q", "K", "V"]
        feeds = [[self.value(x) for x in xs] for xs in inputs]
        if p.mask in (Mask.EXPLICIT, Mask.BIAS):
            names.append("attn_mask")
            feeds.append([self.value(p.visible() if p.mask is Mask.EXPLICIT
                                     else p.additive_mask())])
        attrs = dict(q_num_heads=p.q_heads, kv_num_heads=p.kv_heads, scale=p.scale,
                     is_causal=int(p.mask is Mask.CAUSAL), **softcap_attribute(p))
        shape = ((p.batch, p.q_heads, p.q_len, p.head_dim) if four_d
                 else (p.batch, p.q_len, p.q_heads * p.head_dim))
        self.four_d = four_d
        return self.attention_call(names, feeds, attrs, shape, threads, t.copies)

    def attention_call(self, names: list[str], feeds: list[list[object]], attrs: dict,
                       out_shape: tuple[int, ...], threads: int, copies: int) -> Call:
        """A session of one Attention node (attributes attrs) on the named inputs, feeds
        holding each input's OrtValues (one per copy, or one for all; a boolean or float
        attn_mask), its output bound to self.out (out_shape): the call on copy c."""
        from onnx import TensorProto, helper

        graph_inputs = [
            helper.make_tensor_value_info(
                n, TensorProto.BOOL if f[0].data_type() == "tensor(bool)" else TensorProto.FLOAT,
                list(f[0].shape()))
            for n, f in zip(names, feeds)
        ]
        graph = helper.make_graph(
            [helper.make_node("Attention", names, ["O"], **attrs)], "attention", graph_inputs,
            [helper.make_tensor_value_info("O", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        session = self.session(model, threads)
        self.out = np.empty(out_shape, dtype=np.float32)
        bindings = []
        for c in range(copies):
            io = session.io_binding()
            for n, f in zip(names, feeds):
                io.bind_ortvalue_input(n, f[c % len(f)])
            io.bind_ortvalue_output("O", self.value(self.out))
            bindings.append(io)
        return lambda c: session.run_with_iobinding(bindings[c % len(bindings)])

    def write_output(self, p: Problem, t: Tensors) -> None:
        if self.four_d:
            t.o[...] = self.out.transpose(0, 2, 1, 3)
        else:
            t.o[...] = self.out.reshape(t.o.shape)


class OrtAttentionGrouped(_Grouped, OrtAttention):
    """The same operator on a grouped-query decode step in the folded form (as
    peer-torch-sdpa-grouped): Q [B, Hkv, g, D], the g query heads of a KV head as g query
    rows, against K and V [B, Hkv, L, D] with q_num_heads = kv_num_heads = Hkv and no mask,
    so every K and V row is read once per group. Only for q_len = 1 with g > 1. ALiBi: a
    float attn_mask [1, Hkv, g, Lk], each query head's bias on its own row."""

    how = (
        "folded form of peer-ort-attention: Q [B, Hkv, g, D], q_num_heads = kv_num_heads = "
        "Hkv, no mask (ALiBi: float [1, Hkv, g, Lk]); grouped-query decode only")

    name = "peer-ort-attention-grouped"
    plain = OrtAttention.name

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        b, hkv, g, d = p.batch, p.kv_heads, p.group, p.head_dim
        # [B, 1, H, D] -> [B, Hkv, g, D]: the same memory for a dense q.
        q = [as_token_major(x).reshape(b, hkv, g, d) for x in t.q]
        inputs = [q] + [[as_head_major(x) for x in xs] for xs in (t.k, t.v)]
        feeds = [[self.value(x) for x in xs] for xs in inputs]
        names = ["Q", "K", "V"]
        if p.mask is Mask.BIAS:  # [1, H, 1, Lk] -> [1, Hkv, g, Lk]: head k g + r on row r
            names.append("attn_mask")
            feeds.append([self.value(p.additive_mask().reshape(1, hkv, g, p.kv_len))])
        attrs = dict(q_num_heads=hkv, kv_num_heads=hkv, scale=p.scale, is_causal=0,
                     **softcap_attribute(p))
        return self.attention_call(names, feeds, attrs, (b, hkv, g, d), threads, t.copies)

    def write_output(self, p: Problem, t: Tensors) -> None:
        t.o[...] = self.out.reshape(p.batch, 1, p.q_heads, p.head_dim)


class OrtGqa(_Ort):
    """ONNX Runtime's com.microsoft GroupQueryAttention, its fused operator for LLM
    attention: always causal, bottom-right through the KV cache. Prefill (q_len == kv_len)
    passes K and V token-major with an empty past; decode passes the head-major cache as
    past_key/past_value with present_key/present_value bound to the same buffers (ONNX
    Runtime's shared KV buffer, as generation loops run it), seqlens_k = kv_len - 1, and the
    new tokens' K and V rows as key/value: the operator writes them back to the cache rows
    they came from, so the cache is unchanged. A ragged decode batch (kv_lens) is its native
    form: seqlens_k[b] = kv_lens[b] - 1 per sequence, the new token of sequence b its row
    kv_lens[b] - 1, total_sequence_length the cache's capacity. Attention sinks through its
    head_sink input (ONNX Runtime 1.22 and later); a sliding window of w keys through
    local_window_size = w (so in 1.32: w - 1 and w + 1 fail the peer test). Soft-capping
    through its softcap attribute: c tanh(s / c) of the scaled logit, the sinks uncapped (as
    the project's contract; the peer test tells both apart). ALiBi through its attention_bias
    input, [1, H, Lq, Lk] (a ragged batch's [B, H, 1, Lk]: each sequence's own positions),
    indexed by absolute key position and added to the capped logits; the bias alone, since
    the operator masks by itself (the peer test tells the bias before the cap apart)."""

    how = (
        "com.microsoft GroupQueryAttention, fused, always causal; decode through its shared "
        "past/present KV buffer; ragged decode batches through seqlens_k; sinks through "
        "head_sink; sliding windows through local_window_size; soft-cap through softcap; "
        "ALiBi through attention_bias [1 or B, H, Lq, Lk]")

    name = "peer-ort-gqa"
    ragged = True
    sinks = True
    window = True
    softcap = True
    alibi = True

    def why_unsupported(self, p: Problem) -> str | None:
        if not p.causal:
            return "GroupQueryAttention is always causal"
        if p.kv_lens is not None and p.q_len != 1:
            return "per-sequence lengths as decode steps only (seqlens_k, one new token each)"
        return super().why_unsupported(p)

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        from onnx import TensorProto, helper

        b, hkv, d = p.batch, p.kv_heads, p.head_dim
        past_len = p.kv_len - p.q_len
        q = [self.value(as_token_major(x).reshape(b, p.q_len, -1)) for x in t.q]
        if past_len == 0:
            new_k = [self.value(as_token_major(x).reshape(b, p.q_len, -1)) for x in t.k]
            new_v = [self.value(as_token_major(x).reshape(b, p.q_len, -1)) for x in t.v]
            empty = self.value(np.zeros((b, hkv, 0, d), dtype=np.float32))
            past_k = past_v = [empty]
            present_shape = (b, hkv, p.kv_len, d)
            self.present = [np.empty(present_shape, dtype=np.float32) for _ in range(2)]
            present_k = present_v = None
        else:
            caches_k = [as_head_major(x) for x in t.k]
            caches_v = [as_head_major(x) for x in t.v]
            # Each sequence's new token: the last row of its own keys.
            lens = p.kv_lens if p.kv_lens is not None else (p.kv_len,) * b

            def new_rows(x: np.ndarray) -> object:
                rows = np.stack([x[s, n - p.q_len:n] for s, n in enumerate(lens)])
                return self.value(np.ascontiguousarray(rows.reshape(b, p.q_len, -1)))

            new_k = [new_rows(x) for x in t.k]
            new_v = [new_rows(x) for x in t.v]
            past_k = [self.value(x) for x in caches_k]
            past_v = [self.value(x) for x in caches_v]
            present_k, present_v = past_k, past_v
        seqlens = self.value(np.array([n - 1 for n in p.kv_lens], dtype=np.int32)
                             if p.kv_lens is not None
                             else np.full((b,), p.kv_len - 1, dtype=np.int32))
        total = self.value(np.array(p.kv_len, dtype=np.int32))

        names = ["Q", "K", "V", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
        types = [TensorProto.FLOAT] * 5 + [TensorProto.INT32] * 2
        shapes = [[b, None, p.q_heads * d], [b, None, hkv * d], [b, None, hkv * d],
                  [b, hkv, None, d], [b, hkv, None, d], [b], []]
        feeds = [q, new_k, new_v, past_k, past_v, [seqlens], [total]]
        inputs = list(names)
        # Optional inputs 10 and 11 (7-9, rotary and position ids, absent): ALiBi's bias
        # alone, its columns the keys' positions, and the sinks.
        order = ("attention_bias", "head_sink")
        optional = {}
        if p.has_alibi:
            optional["attention_bias"] = p.alibi_bias(np.float32)
        if p.sinks is not None:
            optional["head_sink"] = np.array(p.sinks, dtype=np.float32)
        if optional:
            last = max(order.index(n) for n in optional)
            inputs += ["", "", ""] + [n if n in optional else "" for n in order[:last + 1]]
        for n, x in optional.items():
            names.append(n)
            types.append(TensorProto.FLOAT)
            shapes.append(list(x.shape))
            feeds.append([self.value(x)])
        window = dict(local_window_size=p.window) if 0 < p.window < p.kv_len else {}
        node = helper.make_node(
            "GroupQueryAttention", inputs, ["O", "present_key", "present_value"],
            domain="com.microsoft", num_heads=p.q_heads, kv_num_heads=hkv, scale=p.scale,
            **window, **softcap_attribute(p))
        graph = helper.make_graph(
            [node], "gqa",
            [helper.make_tensor_value_info(n, ty, s) for n, ty, s in zip(names, types, shapes)],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
             for n in ("O", "present_key", "present_value")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        session = self.session(model, threads)
        self.out = np.empty((b, p.q_len, p.q_heads * d), dtype=np.float32)
        bindings = []
        for c in range(t.copies):
            io = session.io_binding()
            for n, f in zip(names, feeds):
                io.bind_ortvalue_input(n, f[c % len(f)])
            io.bind_ortvalue_output("O", self.value(self.out))
            if present_k is None:
                io.bind_ortvalue_output("present_key", self.value(self.present[0]))
                io.bind_ortvalue_output("present_value", self.value(self.present[1]))
            else:
                io.bind_ortvalue_output("present_key", present_k[c % len(present_k)])
                io.bind_ortvalue_output("present_value", present_v[c % len(present_v)])
            bindings.append(io)
        return lambda c: session.run_with_iobinding(bindings[c % len(bindings)])

    def write_output(self, p: Problem, t: Tensors) -> None:
        t.o[...] = self.out.reshape(t.o.shape)


class OpenVinoSdpa(Peer):
    """OpenVINO's opset13 ScaledDotProductAttention on its CPU plugin, f32 precision hint:
    Q [B, Hkv, g, Lq, D] against K, V [B, Hkv, 1, Lk, D] (broadcast over the g query heads
    of a group), the reshapes and transposes from the tensors' layouts inside the model,
    causal (top-left) when q_len == kv_len, a boolean mask otherwise (bottom-right causal, a
    sliding window; a ragged batch's: [B, 1, 1, Lq, Lk]). The operator has no soft-cap, nor
    has any fused node of the 2026.4 CPU plugin: a capped problem is not an OpenVINO peer's
    (its ONNX frontend decomposes Attention's softcap into Div, Tanh, Mul). ALiBi through its
    float mask input, which it adds to the scaled logits (Mask.BIAS, [1 or B, Hkv, g, Lq,
    Lk]: the bias, -inf where masked; causal off)."""

    how = (
        "opset13 SDPA, plain model: Q [B, Hkv, g, Lq, D] against K, V [B, Hkv, 1, Lk, D]; "
        "mask: causal (Lq = Lk), else boolean (sliding windows; ragged batches: per "
        "sequence); ALiBi: a float mask [1 or B, Hkv, g, Lq, Lk], the bias and -inf where "
        "masked; fused path: no (decomposed or a Snippets subgraph)")

    name = "peer-openvino-sdpa"
    package = "openvino"
    ragged = True
    window = True
    alibi = True

    def load(self) -> None:
        import openvino
        import openvino.opset13

        self.ov = openvino
        self.ops = openvino.opset13
        self.core = openvino.Core()

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        ov, ops = self.ov, self.ops
        b, h, hkv, g, d = p.batch, p.q_heads, p.kv_heads, p.group, p.head_dim
        q_in = [as_token_major(x) for x in t.q]
        q_param = ops.parameter([b, p.q_len, h, d], np.float32)
        q5 = ops.transpose(ops.reshape(q_param, [b, p.q_len, hkv, g, d], False), [0, 2, 3, 1, 4])

        def kv(xs: list[np.ndarray]) -> tuple[list[np.ndarray], object, object]:
            if is_head_major(xs[0]):
                arrays = [as_head_major(x) for x in xs]
                param = ops.parameter([b, hkv, p.kv_len, d], np.float32)
                return arrays, param, ops.unsqueeze(param, 2)
            arrays = [as_token_major(x) for x in xs]
            param = ops.parameter([b, p.kv_len, hkv, d], np.float32)
            return arrays, param, ops.unsqueeze(ops.transpose(param, [0, 2, 1, 3]), 2)

        k_in, k_param, k5 = kv(t.k)
        v_in, v_param, v5 = kv(t.v)
        params = [q_param, k_param, v_param]
        arrays = [q_in, k_in, v_in]
        scale = ops.constant(np.float32(p.scale))
        if p.mask in (Mask.EXPLICIT, Mask.RAGGED, Mask.BIAS):
            if p.mask is Mask.BIAS:  # [1 or B, H, Lq, Lk] -> [1 or B, Hkv, g, Lq, Lk]
                bias = p.additive_mask()
                mask = bias.reshape(bias.shape[0], hkv, g, p.q_len, p.kv_len)
            else:
                mask = p.visible() if p.mask is Mask.EXPLICIT else p.sequences_visible()[:, None]
            mask_param = ops.parameter(list(mask.shape), mask.dtype.type)
            params.append(mask_param)
            arrays.append([np.ascontiguousarray(mask)])
            out = ops.scaled_dot_product_attention(q5, k5, v5, mask_param, scale, causal=False)
        else:
            zero = ops.constant(np.zeros((1, 1), dtype=np.float32))
            out = ops.scaled_dot_product_attention(q5, k5, v5, zero, scale,
                                                   causal=p.mask is Mask.CAUSAL)
        model = ov.Model([out], params, "sdpa")
        compiled = self.core.compile_model(model, "CPU", {
            "INFERENCE_PRECISION_HINT": "f32",
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        })
        request = compiled.create_infer_request()
        tensors = [[ov.Tensor(a, shared_memory=True) for a in xs] for xs in arrays]
        self.request = request

        def call(c: int) -> None:
            for i, xs in enumerate(tensors):
                request.set_input_tensor(i, xs[c % len(xs)])
            request.infer()

        return call

    def write_output(self, p: Problem, t: Tensors) -> None:
        out = self.request.get_output_tensor(0).data  # [B, Hkv, g, Lq, D]
        t.o[...] = out.reshape(p.batch, p.q_heads, p.q_len, p.head_dim).transpose(0, 2, 1, 3)


class OpenVinoSdpaKvCache(OpenVinoSdpa):
    """OpenVINO's fused attention: the CPU plugin keeps ScaledDotProductAttention as its own
    node (not decomposed into MatMul and Softmax, nor tokenized by Snippets) only in a model
    with state, the form of an LLM exported for generation, so this peer builds that form:
    K and V caches as state variables (ReadValue, Gather by beam_idx, Concat with the new
    tokens, Assign), Q [B, H, Lq, D], and for g > 1 each cache broadcast over its group
    (Unsqueeze, Broadcast [1, 1, g, 1, 1], Reshape), which the plugin folds into the node.
    Prefill (Lq = Lk): the state is reset before every call and K, V come in as new tokens.
    Decode (Lq = 1): the first Lk - 1 keys are set as the state, and each call appends the
    last key, as a generation step does; every 2 sqrt(Lk) calls the state is set back (see
    prepare). ALiBi in prefill through the node's float mask input, [1, H, Lq, Lk] (the bias,
    -inf where masked; causal off), with the scale as its own input; not in decode,
    where every call's mask would have to grow with the cache (peer-openvino-sdpa takes it).
    The peer test asserts that the compiled model holds the ScaledDotProductAttention node
    for every kind of problem."""

    how = (
        "opset13 SDPA in the stateful KV-cache form of an exported LLM, K, V broadcast over "
        "each group; prefill and decode only; f16/bf16 K, V: KV_CACHE_PRECISION of the type, "
        "i8 (decode): u8 (its own scales and zero points, quantized from the stored values); "
        "ALiBi (prefill): a float mask [1, H, Lq, Lk], the bias and -inf where masked; "
        "fused path: yes, its ScaledDotProductAttention node (asserted by the peer tests)")

    name = "peer-openvino-sdpa-kvcache"
    # f16 and bf16 through the plugin's KV_CACHE_PRECISION: the cache is given (and set as
    # the state) in fp32 holding the stored values, which the plugin keeps in the type
    # exactly. i8 through its u8 cache: the plugin quantizes the stored values again with a
    # scale and a zero point per group of its own (bench/peers.h, peer_bound, bounds what that
    # moves), so the bytes it reads per element are i8's.
    kv_types = ("f32", "f16", "bf16", "i8")
    CACHE_PRECISION = {"f32": "f32", "f16": "f16", "bf16": "bf16", "i8": "u8"}
    ragged = False  # one state shared by the batch: no per-sequence lengths
    window = False  # its fused node is given no boolean mask

    def why_unsupported(self, p: Problem) -> str | None:
        if p.q_len != 1 and p.q_len != p.kv_len:
            return "a generation loop's forms only: prefill (Lq = Lk) or decode (Lq = 1)"
        if p.kv_type == "i8" and p.q_len != 1:
            return ("K and V in i8: its prefill attends over the new tokens in fp32 (the u8 "
                    "cache is what later steps read): decode only")
        if p.has_alibi and p.q_len != p.kv_len:
            return ("ALiBi in decode: each call's mask would grow with the cache; prefill "
                    "only")
        return super().why_unsupported(p)

    def model(self, p: Problem, k_head_major: bool, v_head_major: bool) -> Any:
        """The stateful model: inputs q [B, Lq, H, D], the new K and V tokens in their
        layouts, beam_idx [B], and with ALiBi (prefill) the mask [1, H, Lq, Lk]; output
        [B, H, Lq, D]."""
        from openvino import opset6
        from openvino.op.util import Variable, VariableInfo

        ov, ops = self.ov, self.ops
        b, h, hkv, g, d = p.batch, p.q_heads, p.kv_heads, p.group, p.head_dim
        q_param = ops.parameter([b, -1, h, d], np.float32, name="q")
        q = ops.transpose(q_param, [0, 2, 1, 3])
        beam = ops.parameter([b], np.int32, name="beam_idx")
        params, sinks, caches = [q_param], [], []
        for name, head_major in (("k", k_head_major), ("v", v_head_major)):
            shape = [b, hkv, -1, d] if head_major else [b, -1, hkv, d]
            param = ops.parameter(shape, np.float32, name=name)
            params.append(param)
            new = param if head_major else ops.transpose(param, [0, 2, 1, 3])
            info = VariableInfo()
            info.data_shape = ov.PartialShape([b, hkv, -1, d])
            info.data_type = ov.Type.f32
            info.variable_id = f"{name}_cache"
            variable = Variable(info)
            empty = ops.constant(np.zeros([b, hkv, 0, d], np.float32))
            past = ops.gather(opset6.read_value(empty, variable), beam, ops.constant(0))
            cache = ops.concat([past, new], 2)
            sinks.append(opset6.assign(cache, variable))
            if g > 1:
                wide = ops.broadcast(ops.unsqueeze(cache, 2),
                                     ops.constant(np.array([1, 1, g, 1, 1], np.int64)),
                                     broadcast_spec="BIDIRECTIONAL")
                cache = ops.reshape(wide, ops.constant(np.array([b, h, -1, d], np.int64)),
                                    False)
            caches.append(cache)
        params.append(beam)
        if p.has_alibi:  # the additive mask (Mask.BIAS) and the scale as inputs of the node
            mask = ops.parameter([1, h, -1, -1], np.float32, name="mask")
            params.append(mask)
            out = ops.scaled_dot_product_attention(q, caches[0], caches[1], mask,
                                                   ops.constant(np.float32(p.scale)),
                                                   causal=False)
            return ov.Model([out.output(0)], sinks, params, "sdpa_kv_cache")
        # No mask input otherwise: with a [1, 1] zero mask (needed to pass a scale) the fused
        # node gave wrong and varying outputs in 2026.4. So the default scale 1 / sqrt(D), and
        # any other folded into q (one more rounding).
        if np.float32(p.scale) != np.float32(1.0 / math.sqrt(d)):
            q = ops.multiply(q, ops.constant(np.float32(p.scale * math.sqrt(d))))
        out = ops.scaled_dot_product_attention(q, caches[0], caches[1],
                                               causal=p.q_len > 1 and p.mask is Mask.CAUSAL)
        return ov.Model([out.output(0)], sinks, params, "sdpa_kv_cache")

    def compile(self, p: Problem, k_head_major: bool, v_head_major: bool, threads: int) -> Any:
        return self.core.compile_model(self.model(p, k_head_major, v_head_major), "CPU", {
            "INFERENCE_PRECISION_HINT": "f32",
            "KV_CACHE_PRECISION": self.CACHE_PRECISION[p.kv_type],
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        })

    def prepare(self, p: Problem, t: Tensors, threads: int) -> Call:
        ov = self.ov
        k_hm, v_hm = is_head_major(t.k[0]), is_head_major(t.v[0])
        compiled = self.compile(p, k_hm, v_hm, threads)
        request = compiled.create_infer_request()
        self.request = request
        beam = ov.Tensor(np.arange(p.batch, dtype=np.int32))  # each sequence its own cache

        def layout(x: np.ndarray, head_major: bool) -> np.ndarray:
            return as_head_major(x) if head_major else as_token_major(x)

        if p.kv_type != "f32":  # the stored values in fp32, in the same layouts
            t = Tensors(t.q, [t.widened(p, "k", c) for c in range(t.copies)],
                        [t.widened(p, "v", c) for c in range(t.copies)], t.o)

        # The arrays stay referenced here as long as the tensors that share their memory.
        self.arrays = [[as_token_major(x) for x in t.q]]
        q = [ov.Tensor(x, shared_memory=True) for x in self.arrays[0]]
        if p.q_len > 1:  # prefill: the whole prompt as new tokens, from an empty cache
            self.arrays += [[layout(x, k_hm) for x in t.k], [layout(x, v_hm) for x in t.v]]
            k = [ov.Tensor(x, shared_memory=True) for x in self.arrays[1]]
            v = [ov.Tensor(x, shared_memory=True) for x in self.arrays[2]]
            if p.has_alibi:
                self.arrays.append([p.additive_mask()])
                mask = [ov.Tensor(self.arrays[3][0], shared_memory=True)]
            else:
                mask = []

            def prefill(c: int) -> None:
                request.reset_state()
                request.infer([q[c % len(q)], k[c % len(k)], v[c % len(v)], beam, *mask])

            return prefill
        # Decode: keys [0, Lk - 1) in the cache (copied into the plugin's state), key Lk - 1
        # as the step's new token. Each call appends it, as a generation step does, so every
        # `period` = 2 sqrt(Lk) calls the cache is set back to its first Lk - 1 keys (a copy,
        # inside the timed loop): it stays within 2 sqrt(Lk) keys of Lk, and the copies cost
        # about 2 / sqrt(Lk) of the peer's time (1.1% at 32768 keys).
        initial = {name: np.ascontiguousarray(as_head_major(xs[0])[:, :, :-1])
                   for name, xs in (("k_cache", t.k), ("v_cache", t.v))}
        states = list(request.query_state())

        def restore() -> None:
            for state in states:
                state.state = ov.Tensor(initial[state.name])

        restore()
        last = []
        for x, head_major in ((t.k[0], k_hm), (t.v[0], v_hm)):
            step = as_head_major(x)[:, :, -1:] if head_major else as_token_major(x)[:, -1:]
            last.append(ov.Tensor(np.ascontiguousarray(step)))
        period = max(1, int(2 * math.sqrt(p.kv_len)))
        steps = [0]

        def step_call(c: int) -> None:
            if steps[0] == period:
                restore()
                steps[0] = 0
            steps[0] += 1
            request.infer([q[c % len(q)], last[0], last[1], beam])

        return step_call

    def write_output(self, p: Problem, t: Tensors) -> None:
        out = self.request.get_output_tensor(0).data  # [B, H, Lq, D]
        t.o[...] = out.transpose(0, 2, 1, 3)

    def runtime_layer_types(self, p: Problem, k_head_major: bool, v_head_major: bool) -> set[str]:
        """The layer types of the compiled model (for the peer test)."""
        compiled = self.compile(p, k_head_major, v_head_major, 1)
        ops = compiled.get_runtime_model().get_ops()
        return {n.get_rt_info()["layerType"].astype(str) for n in ops}


class TorchMatmul(GemmPeer):
    """torch.matmul(a, b, out=c) on tensors over the shared buffers (torch.from_numpy: no
    copy), so every call writes C in place. Outside inference_mode: no tensor requires grad,
    so autograd records nothing, and the context would add its own microseconds to the
    small products of decoding."""

    how = "torch.matmul(a, b, out=c) on the shared buffers, no copy"

    name = "peer-torch-matmul"
    package = "torch"

    def load(self) -> None:
        self.torch = load_torch()

    def prepare(self, s: Gemm, t: GemmTensors, threads: int) -> Call:
        torch = self.torch
        torch.set_num_threads(threads)
        a, b, c = (torch.from_numpy(x) for x in (t.a, t.b, t.c))

        def call(_: int) -> None:
            torch.matmul(a, b, out=c)

        return call


class TorchLayer(LayerPeer):
    """The layer as a PyTorch user writes it, under inference_mode: q, k, v = F.linear(x, W,
    b) with nn.Linear's weights ([out][in], contiguous: converted from the math layout once,
    at prepare); the n new tokens' K and V slice-assigned into positions [past, past + n) of
    a preallocated head-major cache tensor of capacity past + n (a static cache, copied from
    mha_bench's at prepare, whose buffers stay unchanged); scaled_dot_product_attention of
    the [B, H, n, D] queries over the whole cache, its default scale 1 / sqrt(D), enable_gqa
    for Hkv < H as peer-torch-sdpa, is_causal when past = 0, nothing when n = 1 (a decoded
    token sees the whole cache), a boolean mask for bottom-right causal otherwise; then
    F.linear(o, W^O, b^O). x is read in place; y is the framework's own tensor, copied into
    mha_bench's after prepare's call. Every call writes the same cache positions, so the
    timed calls are identical steps."""

    how = (
        "projections by F.linear or by TorchScript-frozen nn.Linear with oneDNN-prepacked weights"
        " (optimize_for_inference), whichever is faster at prepare; a static head-major cache; "
        "SDPA as peer-torch-sdpa; under inference_mode")

    name = "peer-torch-layer"
    package = "torch"

    def load(self) -> None:
        self.torch = load_torch()

    def prepare(self, s: Layer, t: LayerTensors, threads: int) -> Call:
        torch = self.torch
        linear = torch.nn.functional.linear
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.set_num_threads(threads)
        b, n, h, hkv, dim = s.batch, s.n, s.heads, s.kv_heads, s.head_dim

        def weight(w: np.ndarray) -> Any:  # [in][out] -> nn.Linear's [out][in], its own copy
            return torch.from_numpy(w).t().contiguous()

        def bias(x: np.ndarray | None) -> Any:
            return None if x is None else torch.from_numpy(x).clone()

        def cache(c: np.ndarray | None) -> Any:
            own = torch.zeros((b, hkv, s.capacity, dim), dtype=torch.float32)
            if c is not None:
                own.copy_(torch.from_numpy(c))
            return own

        wq, wk, wv, wo = (weight(w) for w in (t.wq, t.wk, t.wv, t.wo))
        bq, bk, bv, bo = (bias(x) for x in (t.bq, t.bk, t.bv, t.bo))
        k_cache, v_cache = cache(t.k_cache), cache(t.v_cache)
        x = torch.from_numpy(t.x)
        q_proj, k_proj, v_proj = self.projections(
            [(wq, bq), (wk, bk), (wv, bv)], x)
        o_proj = self.projections([(wo, bo)], torch.zeros(b, n, h * dim))[0]
        attention = s.attention
        mask = torch.from_numpy(attention.visible()) if attention.mask is Mask.EXPLICIT else None
        is_causal = attention.mask is Mask.CAUSAL
        new = slice(s.past, s.capacity)
        self.y = None

        def call(_: int) -> None:
            with torch.inference_mode():
                q = q_proj(x).view(b, n, h, dim).transpose(1, 2)
                k_cache[:, :, new] = k_proj(x).view(b, n, hkv, dim).transpose(1, 2)
                v_cache[:, :, new] = v_proj(x).view(b, n, hkv, dim).transpose(1, 2)
                o = sdpa(q, k_cache, v_cache, attn_mask=mask, is_causal=is_causal,
                         enable_gqa=hkv != h)
                self.y = o_proj(o.transpose(1, 2).reshape(b, n, h * dim))

        return call

    def projections(self, weights: list[tuple[Any, Any]], x: Any) -> list[Callable[[Any], Any]]:
        """x W + b for each (W [out][in], b): F.linear, or nn.Linear frozen by TorchScript and
        optimize_for_inference (its weights prepacked for oneDNN), whichever ran the first
        pair faster on x here (one call each after a warm-up); F.linear where freezing is not
        available. Records the choice in self.packed."""
        torch = self.torch
        linear = torch.nn.functional.linear
        plain = [lambda y, w=w, b=b: linear(y, w, b) for w, b in weights]
        self.packed = False
        if not torch.backends.mkldnn.is_available():
            return plain
        try:
            packed = []
            for w, b in weights:
                module = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
                with torch.no_grad():
                    module.weight.copy_(w)
                    if b is not None:
                        module.bias.copy_(b)
                with warnings.catch_warnings():  # TorchScript is deprecated, still served
                    warnings.simplefilter("ignore", FutureWarning)
                    frozen = torch.jit.freeze(torch.jit.script(module.eval()))
                    packed.append(torch.jit.optimize_for_inference(frozen))
        except Exception:  # an old or a stripped build: the plain form
            return plain

        def seconds(f: Callable[[Any], Any]) -> float:
            with torch.inference_mode():
                f(x)
                start = time.perf_counter()
                f(x)
                return time.perf_counter() - start

        self.packed = seconds(packed[0]) < seconds(plain[0])
        print(f"{self.name}: projections of {tuple(x.shape)}: "
              f"{'prepacked (frozen TorchScript)' if self.packed else 'F.linear'}",
              file=sys.stderr)
        return packed if self.packed else plain

    def write_output(self, s: Layer, t: LayerTensors) -> None:
        t.y[...] = self.y.numpy()


ATTENTION: list[type[Peer]] = [TorchSdpa, TorchSdpaGrouped, OrtAttention, OrtAttentionGrouped,
                               OrtGqa, OpenVinoSdpa, OpenVinoSdpaKvCache]
GEMM: list[type[GemmPeer]] = [TorchMatmul]
LAYER: list[type[LayerPeer]] = [TorchLayer]
ALL: list[type[Framework]] = [*ATTENTION, *GEMM, *LAYER]  # the server's peers, in this order

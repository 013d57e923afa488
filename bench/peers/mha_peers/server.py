"""The peer server: one request per line on standard input, one reply per line on standard
output (the protocol is described in bench/peers.h). Logs go to standard error."""

from __future__ import annotations

import sys
import time
import traceback
from functools import partial
from typing import IO, Callable

import numpy as np

from .frameworks import ALL, Call, Framework, GemmPeer, LayerPeer, Peer
from .layer import Gemm, GemmTensors, Layer, LayerTensors
from .problem import Problem, SharedBuffers, Tensors

# The kind of problem each supports and prepare request is about (Framework.kind).
SUPPORTS = {"supports": "attention", "supports_gemm": "gemm", "supports_layer": "layer"}
PREPARE = {"prepare": "attention", "prepare_gemm": "gemm", "prepare_layer": "layer"}

# The layer's tensors by their prepare_layer field: always, with bias=1, and the KV cache
# (required when past > 0; with past = 0 the peer starts from an empty cache).
LAYER_TENSORS = ("x", "wq", "wk", "wv", "wo", "y")
LAYER_BIASES = ("bq", "bk", "bv", "bo")
LAYER_CACHE = ("k_cache", "v_cache")


def parse_fields(words: list[str]) -> dict[str, str]:
    fields = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got '{word}'")
        fields[key] = value
    return fields


def wrong_kind(peer: Framework, kind: str) -> str | None:
    """Why `peer` cannot take a problem of this kind, or None when it can."""
    if peer.kind == kind:
        return None
    return f"{peer.name} computes {peer.kind} problems, not {kind}"


class Server:
    def __init__(self, peers: list[Framework]) -> None:
        self.peers = {p.name: p for p in peers}
        self.buffers = SharedBuffers()
        self.call: Call | None = None
        self.flush: np.ndarray | None = None  # the cold= buffer of the prepared problem
        self.copies = 1
        self.copy = 0

    def handle(self, line: str) -> str:
        words = line.split()
        if not words:
            return "error empty request"
        op, args = words[0], words[1:]
        try:
            if op in SUPPORTS:
                why = self.why_unsupported(self.peers[args[0]], SUPPORTS[op],
                                           parse_fields(args[1:]))
                return "yes" if why is None else f"no {why}"
            if op in PREPARE:
                return self.prepare(self.peers[args[0]], PREPARE[op], parse_fields(args[1:]))
            if op == "run":
                return self.run(int(args[0]))
            if op == "release":
                self.call = None
                self.buffers.clear()
                return "ok"
            return f"error unknown request '{op}'"
        except KeyError as e:
            return f"error unknown peer or missing field {e}"
        except Exception as e:  # a framework's own error: reported, the server goes on
            traceback.print_exc(file=sys.stderr)
            return f"error {type(e).__name__}: {' '.join(str(e).split())[:300]}"

    def why_unsupported(self, peer: Framework, kind: str, fields: dict[str, str]) -> str | None:
        why = wrong_kind(peer, kind)
        if why is not None:
            return why
        if isinstance(peer, Peer):
            return peer.why_unsupported(Problem.parse(fields).sliced())
        if isinstance(peer, GemmPeer):
            return peer.why_unsupported(Gemm.parse(fields))
        if isinstance(peer, LayerPeer):
            return peer.why_unsupported(Layer.parse(fields))
        return f"{peer.name} serves no known kind of problem"

    def prepare(self, peer: Framework, kind: str, fields: dict[str, str]) -> str:
        """Builds the peer's call, calls it once (timed) and writes its output to the shared
        tensor; on any error the previous call is gone too (run answers an error)."""
        self.call = None
        self.flush = None
        why = self.why_unsupported(peer, kind, fields)
        if why is not None:
            return f"error unsupported: {why}"
        threads = int(fields["threads"])
        write: Callable[[], None]
        copies = 1
        if isinstance(peer, Peer):
            p = Problem.parse(fields)
            names = ["q", "k", "v", "o"] + (["k_scale", "v_scale"] if p.kv_type == "i8" else [])
            files = {n: fields[n].split(",") for n in names}
            buffers = {n: [self.buffers.get(f) for f in fs] for n, fs in files.items()}
            t = Tensors.from_buffers(p, buffers["q"], buffers["k"], buffers["v"],
                                     buffers["o"][0], buffers.get("k_scale"),
                                     buffers.get("v_scale"))
            # A window every row shares: the problem over its keys alone, as a user calls a
            # framework for it (Problem.window_start).
            p, t = p.sliced(), t.sliced(p)
            call = peer.prepare(p, t, threads)
            write, copies = partial(peer.write_output, p, t), t.copies
        elif isinstance(peer, GemmPeer):
            g = Gemm.parse(fields)
            gt = GemmTensors.from_buffers(g, *(self.buffers.get(fields[n]) for n in "abc"))
            call = peer.prepare(g, gt, threads)
            write = partial(peer.write_output, g, gt)
        elif isinstance(peer, LayerPeer):
            s = Layer.parse(fields)
            names = [*LAYER_TENSORS, *(LAYER_BIASES if s.bias else ()),
                     *(n for n in LAYER_CACHE if s.past > 0 or fields.get(n))]
            lt = LayerTensors.from_buffers(s, {n: self.buffers.get(fields[n]) for n in names})
            call = peer.prepare(s, lt, threads)
            write = partial(peer.write_output, s, lt)
        else:
            return f"error {peer.name} serves no known kind of problem"
        start = time.perf_counter()
        call(0)
        seconds = time.perf_counter() - start
        write()
        self.call, self.copies, self.copy = call, copies, 0
        # cold=<bytes>: before each timed call of run, untimed, read a buffer that large (a
        # float per 64-byte line), so that every call finds its data in no cache, as mha_bench
        # times its own calls of the same problem (bench/layer_bench.cpp, timed_loop).
        cold = int(fields.get("cold", "0"))
        if cold > 0:
            self.flush = np.ones(cold // 4, dtype=np.float32)
        return f"ok {seconds:.9g}"

    def run(self, n: int) -> str:
        if self.call is None:
            return "error run before prepare"
        call, copies, c = self.call, self.copies, self.copy
        if self.flush is not None:  # cold: each call timed alone, after the flush
            seconds = 0.0
            for _ in range(n):
                float(self.flush[::16].sum())
                start = time.perf_counter()
                call(c)
                seconds += time.perf_counter() - start
                c = c + 1 if c + 1 < copies else 0
            self.copy = c
            return f"ok {seconds:.9g}"
        start = time.perf_counter()
        for _ in range(n):
            call(c)
            c = c + 1 if c + 1 < copies else 0
        seconds = time.perf_counter() - start
        self.copy = c
        return f"ok {seconds:.9g}"


def load_peers(out: IO[str]) -> list[Framework]:
    """Imports every framework; announces each as a peer or a skip."""
    peers: list[Framework] = []
    for cls in ALL:
        peer = cls()
        try:
            peer.load()
            out.write(f"peer {peer.name} {peer.version()}\n")
            if peer.how:
                out.write(f"how {peer.name} {peer.how}\n")
            peers.append(peer)
        except Exception as e:  # not installed, or broken: a skip line, never a crash
            out.write(f"skip {peer.name} {type(e).__name__}: {' '.join(str(e).split())[:200]}\n")
    return peers


def serve(inp: IO[str], out: IO[str]) -> int:
    server = Server(load_peers(out))
    out.write("ready\n")
    out.flush()
    for line in inp:
        out.write(server.handle(line) + "\n")
        out.flush()
    return 0

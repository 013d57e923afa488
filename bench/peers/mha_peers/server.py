"""The peer server: one request per line on standard input, one reply per line on standard
output (the protocol is described in bench/peers.h). Logs go to standard error."""

from __future__ import annotations

import sys
import time
import traceback
from typing import IO

from .frameworks import ALL, Call, Peer
from .problem import Problem, SharedBuffers, Tensors


def parse_fields(words: list[str]) -> dict[str, str]:
    fields = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got '{word}'")
        fields[key] = value
    return fields


class Server:
    def __init__(self, peers: list[Peer]) -> None:
        self.peers = {p.name: p for p in peers}
        self.buffers = SharedBuffers()
        self.call: Call | None = None
        self.copy = 0

    def handle(self, line: str) -> str:
        words = line.split()
        if not words:
            return "error empty request"
        op, args = words[0], words[1:]
        try:
            if op == "supports":
                peer = self.peers[args[0]]
                why = peer.why_unsupported(Problem.parse(parse_fields(args[1:])))
                return "yes" if why is None else f"no {why}"
            if op == "prepare":
                return self.prepare(self.peers[args[0]], parse_fields(args[1:]))
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

    def prepare(self, peer: Peer, fields: dict[str, str]) -> str:
        p = Problem.parse(fields)
        why = peer.why_unsupported(p)
        if why is not None:
            return f"error unsupported: {why}"
        files = {n: fields[n].split(",") for n in ("q", "k", "v", "o")}
        buffers = {n: [self.buffers.get(f) for f in fs] for n, fs in files.items()}
        t = Tensors.from_buffers(p, buffers["q"], buffers["k"], buffers["v"], buffers["o"][0])
        self.call = peer.prepare(p, t, int(fields["threads"]))
        self.copy = 0
        start = time.perf_counter()
        self.call(0)
        seconds = time.perf_counter() - start
        peer.write_output(p, t)
        self.copies = t.copies
        return f"ok {seconds:.9g}"

    def run(self, n: int) -> str:
        if self.call is None:
            return "error run before prepare"
        call, copies, c = self.call, self.copies, self.copy
        start = time.perf_counter()
        for _ in range(n):
            call(c)
            c = c + 1 if c + 1 < copies else 0
        seconds = time.perf_counter() - start
        self.copy = c
        return f"ok {seconds:.9g}"


def load_peers(out: IO[str]) -> list[Peer]:
    """Imports every framework; announces each as a peer or a skip."""
    peers = []
    for cls in ALL:
        peer = cls()
        try:
            peer.load()
            out.write(f"peer {peer.name} {peer.version()}\n")
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

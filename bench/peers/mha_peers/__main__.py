"""python -m mha_peers: the peer server mha_bench starts with --peers (bench/peers.h)."""

import sys

from .server import serve

if __name__ == "__main__":
    sys.exit(serve(sys.stdin, sys.stdout))

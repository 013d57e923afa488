"""python -m mha_peers: the peer server mha_bench starts with --peers (bench/peers.h)."""

import os
import sys

from .server import serve

if __name__ == "__main__":
    # The protocol gets its own copy of standard output; file descriptor 1 itself then points
    # at standard error, so that whatever a framework prints (from Python or from C) goes to
    # the log instead of into a reply.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    sys.exit(serve(sys.stdin, protocol))

#!/usr/bin/env bash
# The main job: installs what it needs, builds (Release), and runs the benchmark suite,
# writing Google Benchmark JSON to out/.
#
# Usage: scripts/bench.sh [quick|default|full] [extra mha_bench flags...]
#   e.g. scripts/bench.sh default --benchmark_filter='/avx512/' --benchmark_repetitions=5
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SIZE="${1:-default}"
shift || true

scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target mha_bench -j "$(nproc)"
mkdir -p out
OUT="out/bench-$SIZE-$(date -u +%Y%m%dT%H%M%SZ).json"
build/bench/mha_bench --size="$SIZE" --benchmark_out="$OUT" --benchmark_out_format=json "$@"
echo "mha_bench: results in $OUT"

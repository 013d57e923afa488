#!/usr/bin/env bash
# The main job: installs what it needs (apt packages; the peers' and reports' Python
# environment from PyPI), builds (Release), runs the benchmark suite with the framework
# peers beside the kernels, and writes a report (Markdown with plots, and one HTML page)
# into a dated folder under reports/out/, then prints where it is and the summary table.
#
# Usage: scripts/bench.sh [quick|default|full|cliffs] [extra mha_bench flags...]
#   e.g. scripts/bench.sh default --benchmark_filter='/avx512/'
# Environment:
#   MHA_ROUNDS    rounds per shape (default 1): each shape's kernels and peers run this many
#                 times in turn, so that every ratio in the report has a spread
#   MHA_BASELINE  an earlier results.json: the report compares this run with it (U test)
#   MHA_PEERS=0   no framework peers
# Exit status: mha_bench's (non-zero when a benchmark reported an error), else the report's.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SIZE="${1:-default}"
shift || true
case "$SIZE" in quick | default | full | cliffs) ;; *)
  echo "bench.sh: size must be quick, default, full or cliffs, not '$SIZE'" >&2; exit 2 ;;
esac

scripts/install-deps.sh
python="" peers=()
if [[ ${MHA_PEERS:-1} != 0 ]]; then
  rc=0
  python=$(scripts/setup-python.sh --peers | tail -n 1) || rc=$?
  if ((rc == 77)); then
    echo "bench.sh: peers skipped: PyPI could not be reached; no report either" >&2
    python=""
  elif ((rc != 0)); then
    exit "$rc"
  fi
  [[ -n $python ]] && peers=("--peers=env PYTHONPATH=$REPO/bench/peers $python -m mha_peers")
else
  python=$(scripts/setup-python.sh | tail -n 1) || python=""
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target mha_bench -j "$(nproc)"

OUT="reports/out/$(date -u +%Y%m%dT%H%M%SZ)-$SIZE"
mkdir -p "$OUT"
echo "bench.sh: mha_bench --size=$SIZE --rounds=${MHA_ROUNDS:-1}${peers:+ with the peers}; its table goes to $OUT/console.txt"
status=0
build/bench/mha_bench --size="$SIZE" --rounds="${MHA_ROUNDS:-1}" "${peers[@]}" \
  --benchmark_out="$OUT/results.json" --benchmark_out_format=json \
  --benchmark_counters_tabular=true "$@" >"$OUT/console.txt" || status=$?
if [[ ! -s $OUT/results.json ]]; then
  echo "bench.sh: mha_bench wrote no results (exit status $status); see $OUT/console.txt" >&2
  exit $((status ? status : 1))
fi
echo "bench.sh: results in $OUT/results.json"
if [[ -n $python ]]; then
  PYTHONPATH="$REPO/reports" "$python" -m mha_report "$OUT/results.json" --out "$OUT" \
    ${MHA_BASELINE:+--baseline "$MHA_BASELINE"} || status=$((status ? status : $?))
fi
exit $status

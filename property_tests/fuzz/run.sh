#!/usr/bin/env bash
# Runs one fuzz target under libFuzzer for a bounded time, starting from a temporary copy of
# its committed corpus (the corpus in the repository is never written), and prints what it
# did: inputs executed, coverage (cov: edges, ft: features), corpus size and crashes.
#
# Usage: property_tests/fuzz/run.sh TARGET_BINARY CORPUS_DIR SECONDS [libFuzzer flag...]
#
# A crash, a sanitizer report, a leak, an input slower than 60 s or more than 4 GiB of memory
# fails the run (non-zero exit status) and leaves the input in $MHA_FUZZ_ARTIFACTS (default:
# fuzz-artifacts/ in the current folder); replay it with TARGET_BINARY FILE.
set -uo pipefail

if (($# < 3)); then
  echo "usage: $0 TARGET_BINARY CORPUS_DIR SECONDS [libFuzzer flag...]" >&2
  exit 2
fi
bin=$(realpath "$1")
corpus=$2
seconds=$3
shift 3
name=$(basename "$bin")
[[ -x $bin ]] || { echo "$name: not an executable: $bin" >&2; exit 2; }
[[ -n $(ls -A "$corpus" 2>/dev/null) ]] || { echo "$name: empty or missing corpus: $corpus" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
cp "$corpus"/* "$work/corpus/"
artifacts=$(realpath -m "${MHA_FUZZ_ARTIFACTS:-fuzz-artifacts}")
mkdir -p "$artifacts"

# In the temporary folder: -jobs=N writes its workers' logs (fuzz-<job>.log) there, and
# copies each into its own output when the worker ends.
start=$SECONDS
(cd "$work" && "$bin" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$artifacts/$name-" "$@" corpus) >"$work/log" 2>&1
rc=$?

stat() { grep -aoE "^stat::$1: *[0-9]+" "$work/log" | awk '{s += $2} END {print s + 0}'; }
last=$(grep -aE '^#[0-9]+' "$work/log" | tail -n 1)
cov=$(grep -aoE 'cov: [0-9]+' <<<"$last")
ft=$(grep -aoE 'ft: [0-9]+' <<<"$last")
# Each crash, leak, timeout or memory excess writes one input (libFuzzer stops at the first
# unless told otherwise).
crashes=$(grep -a 'Test unit written to' "$work/log" | grep -vc 'slow-unit')
echo "$name: $(stat number_of_executed_units) inputs in $((SECONDS - start)) s, ${cov:-cov: ?}," \
  "${ft:-ft: ?}, corpus $(ls "$work/corpus" | wc -l) inputs (from $(ls "$corpus" | wc -l))," \
  "crashes: $((rc == 0 ? 0 : (crashes > 0 ? crashes : 1)))"
if ((rc != 0)); then
  # The report: what failed, where, and the input that did it.
  grep -aE -A40 '^(==[0-9]+== ?ERROR|fuzz: |.*runtime error|.*deadly signal|.*-timeout|.*out-of-memory)' \
    "$work/log" | head -n 80
  grep -aE 'Test unit written|^Base64' "$work/log"
  echo "$name: FAILED (libFuzzer's exit status $rc); the input is in $artifacts" >&2
  exit 1  # not libFuzzer's 77, which test runners read as "skipped"
fi

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

# In the temporary folder: -jobs=N writes its workers' logs (fuzz-<job>.log) there.
(cd "$work" && "$bin" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$artifacts/$name-" "$@" corpus) >"$work/log" 2>&1
rc=$?
for job_log in "$work"/fuzz-*.log; do
  [[ -f $job_log ]] && cat "$job_log" >>"$work/log"
done

stat() { grep -aoE "^stat::$1: *[0-9]+" "$work/log" | awk '{s += $2} END {print s + 0}'; }
last=$(grep -aE '^#[0-9]+' "$work/log" | tail -n 1)
cov=$(grep -aoE 'cov: [0-9]+' <<<"$last")
ft=$(grep -aoE 'ft: [0-9]+' <<<"$last")
crashes=$(grep -acE '^(==[0-9]+== ?ERROR|SUMMARY: |fuzz: )' "$work/log")
echo "$name: $(stat number_of_executed_units) inputs in ${seconds} s, ${cov:-cov: ?}," \
  "${ft:-ft: ?}, corpus $(ls "$work/corpus" | wc -l) inputs (from $(ls "$corpus" | wc -l))," \
  "crashes: $((rc == 0 ? 0 : (crashes > 0 ? crashes : 1)))"
if ((rc != 0)); then
  # The report: what failed, where, and the input that did it.
  grep -aE -A40 '^(==[0-9]+== ?ERROR|fuzz: |.*runtime error|.*deadly signal|.*-timeout|.*out-of-memory)' \
    "$work/log" | head -n 80
  grep -aE 'Test unit written|^Base64' "$work/log"
  echo "$name: FAILED (exit status $rc); the input is in $artifacts" >&2
fi
exit "$rc"

#!/usr/bin/env bash
# The test command's own test: a part that fails before ctest must count as failed, skipped
# tests as skipped, and a ctest that selects no test as a failure.
# Runs scripts/test.sh native with a C++ compiler that does not exist, so its CMake configure
# fails for real, in a scratch build root, and checks the exit status, the part's line in the
# table and the closing count. The inner run's output is kept in a file (and shown only on
# failure), so its closing line is never taken for this run's.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log="$work/inner.log"

CMAKE_ARGS="-DCMAKE_CXX_COMPILER=$work/no-such-compiler" MHA_BUILD_ROOT="$work" \
  "$REPO/scripts/test.sh" native >"$log" 2>&1 </dev/null
rc=$?

problems=()
((rc != 0)) || problems+=("exit status 0, expected non-zero")
grep -qE '^native +[0-9]+s  FAILED at configure: ' "$log" ||
  problems+=("no 'native ... FAILED at configure: <why>' line in the parts table")
grep -qxE 'tests: 0 passed, 1 failed' "$log" ||
  problems+=("closing line is not 'tests: 0 passed, 1 failed'")

# The counts of a part's log: skipped ctests and pytest tests are skipped, not passed.
fake="$work/part.log"
printf '%s\n' "100% tests passed, 0 tests failed out of 5" "" \
  "The following tests did not run:" "	  3 - caches/zen (Skipped)" "	 14 - copy/avx512 (Skipped)" \
  "2 passed, 1 skipped in 0.52s" >"$fake"
counts=$( (source "$REPO/scripts/test.sh" && count_tests "$fake"))
[[ $counts == "5 0 3 1" ]] ||
  problems+=("count_tests: '$counts' for 3 + 2 passed and 2 + 1 skipped, expected '5 0 3 1'")
# A ctest that selects no test fails (with a build to ask; scripts/test.sh native makes one).
if [[ -f $REPO/build/CTestTestfile.cmake ]]; then
  if (source "$REPO/scripts/test.sh" && run_ctest "$REPO/build" -L no-such-label) \
    >"$work/none.log" 2>&1; then
    problems+=("run_ctest with a label no test has succeeded")
  fi
fi

if ((${#problems[@]})); then
  echo "--- inner run (scripts/test.sh native, configure forced to fail):"
  sed 's/^/  | /' "$log"
  printf 'summary-test: %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "summary-test: skipped tests count as skipped ($counts); a ctest selecting none fails;"
echo "summary-test: a configure failure counts as 1 failed, exit status $rc:"
grep -E '^native +[0-9]+s' "$log" | sed 's/^/  /'

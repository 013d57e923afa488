#!/usr/bin/env bash
# Every test of the project, from a fresh Debian 12 machine: installs what it needs, builds,
# and runs the suite natively, under AddressSanitizer + UndefinedBehaviorSanitizer, on
# emulated older x86-64 CPUs (Haswell: AVX2, no AVX-512; qemu64: baseline x86-64; a Release
# and a Debug build) and cross-built for aarch64 under qemu, the concurrency tests under
# ThreadSanitizer, the fuzz targets under libFuzzer, and the Python tests of the reports and
# the peers. Ends with a table of the parts (time, ok or the step that failed and why), the
# kernels this CPU could not run, and a closing count.
#
# Usage: scripts/test.sh [part ...]   parts: format native sanitize emulated aarch64 tsan fuzz
#                                            python selftest
#                                     (default: all of them, in that order)
# Environment:
#   JOBS             parallel build and ctest jobs (default: nproc)
#   MHA_BUILD_ROOT   where the build folders go (default: the repository root)
#   CMAKE_ARGS       extra arguments for every CMake configure (split on blanks)
#
# The closing line counts ctest's and pytest's tests (skipped ones as skipped, not passed),
# and counts a part that failed before or outside them (set-up, configure, build) as one
# failed test, so it never says "0 failed" when the exit status is not 0; a part whose ctest
# selects no test fails. A part that cannot run here (exit 77: the Python part without
# PyPI) is listed as skipped, with why.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
JOBS="${JOBS:-$(nproc)}"
BUILD_ROOT="${MHA_BUILD_ROOT:-$REPO}"
read -r -a EXTRA_CMAKE_ARGS <<<"${CMAKE_ARGS:-}"
ALL_PARTS=(format native sanitize emulated aarch64 tsan fuzz python selftest)
PARTS=("$@")
((${#PARTS[@]})) || PARTS=("${ALL_PARTS[@]}")
for p in "${PARTS[@]}"; do
  [[ " ${ALL_PARTS[*]} " == *" $p "* ]] ||
    { echo "unknown part '$p' (parts: ${ALL_PARTS[*]})" >&2; exit 2; }
done

passed=0
failed=0
skipped=0
status=0
declare -a table=()
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT

# step [--quiet] NAME CMD...: one step of a part. Its output goes to the terminal (with
# --quiet only when it fails) and to the step log; when it fails, the step's name and the
# first error line of its output become the part's one-line reason.
step() {
  local quiet=0
  [[ $1 == --quiet ]] && { quiet=1; shift; }
  local name="$1"
  shift
  local rc
  if ((quiet)); then
    "$@" >"$LOGS/step.log" 2>&1
    rc=$?
  else
    "$@" 2>&1 | tee "$LOGS/step.log"
    rc=${PIPESTATUS[0]}
  fi
  if ((rc != 0)); then
    ((quiet)) && cat "$LOGS/step.log"
    # The first error line; one that ends in ':' (CMake's "CMake Error at ...:") with the
    # indented lines below it, which say what.
    local why
    why=$(awk '
      found && /^[^ \t]/ { print msg; exit }
      found { msg = msg " " $0; next }
      /([Ee]rror|FAILED|[Ff]ailed|[Nn]ot found|No such)/ {
        if ($0 !~ /:[[:space:]]*$/) { print; exit }
        found = 1; msg = $0 }
      END { if (found) print msg }' "$LOGS/step.log" | head -n 1)
    [[ -n $why ]] || why=$(tail -n 1 "$LOGS/step.log")
    printf '%s: %s' "$name" "$(tr -s ' \t' ' ' <<<"$why" | sed -E 's/^ //' | cut -c1-160)" \
      >"$LOGS/reason"
  fi
  return "$rc"
}

# count_tests LOG: "passed failed skipped ran" from the ctest and pytest summaries in a part's
# log (ran: 1 when there was any).
count_tests() {
  # ctest: "100% tests passed, 0 tests failed out of 42"
  # Skipped tests count as skipped, not passed: ctest lists them ("  12 - name (Skipped)")
  # under "The following tests did not run:", and counts them in its total.
  local log="$1" line p=0 f=0 s=0 ran=0
  while read -r line; do
    local lf total
    lf=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    p=$((p + total - lf))
    f=$((f + lf))
    ran=1
  done < <(grep -E 'tests passed, [0-9]+ tests? failed out of' "$log")
  local ctest_skipped
  ctest_skipped=$(grep -cE '^[[:space:]]*[0-9]+ - .* \(Skipped\)$' "$log")
  p=$((p - ctest_skipped))
  s=$((s + ctest_skipped))
  # pytest -q: "3 failed, 29 passed, 2 skipped in 2.12s" (without -q inside "=== ... ===")
  while read -r line; do
    local n
    n=$(grep -oE '[0-9]+ passed' <<<"$line" | cut -d' ' -f1)
    p=$((p + ${n:-0}))
    n=$(grep -oE '[0-9]+ (failed|errors?)' <<<"$line" | awk '{s += $1} END {print s + 0}')
    f=$((f + ${n:-0}))
    n=$(grep -oE '[0-9]+ skipped' <<<"$line" | cut -d' ' -f1)
    s=$((s + ${n:-0}))
    ran=1
  done < <(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)[^=]* in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$log")
  echo "$p $f $s $ran"
}

# part NAME CMD...: runs one part, times it, adds up the ctest counts it printed and keeps
# its log for the summary of skipped tests.
part() {
  local name="$1"
  shift
  local log="$LOGS/part-$name.log" start rc
  start=$(date +%s)
  echo "=== $name"
  rm -f "$LOGS/reason"
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local p f s ran
  read -r p f s ran < <(count_tests "$log")
  local result=ok
  if ((rc == 77)); then
    rc=0  # a part that could not run here (e.g. no PyPI): said, neither passed nor failed
    ran=1
    result="skipped: $(cat "$LOGS/reason" 2>/dev/null)"
  elif ((rc != 0)); then
    status=1
    if ((f == 0)); then
      f=1  # failed before or outside ctest: one failure, never none
      result="FAILED at $(cat "$LOGS/reason" 2>/dev/null || echo "exit status $rc")"
    else
      result="FAILED: $f of $((p + f)) tests"
    fi
  elif ((ran == 0)) && [[ $name != deps ]]; then
    p=1  # a check outside ctest (format, selftest): one test
  fi
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + s))
  table+=("$(printf '%-10s %5ds  %s' "$name" $(($(date +%s) - start)) "$result")")
}

configure_build() {  # build_dir, cmake args...
  local dir="$1"
  shift
  step --quiet configure cmake -S . -B "$dir" -G Ninja -DMHA_WERROR=ON "$@" "${EXTRA_CMAKE_ARGS[@]}" &&
    step build cmake --build "$dir" -j "$JOBS"
}

# run_ctest BUILD_DIR [ctest args...]: the tests of a build; selecting none is an error.
# Then, from ctest's log, the whole-binary tests (many GoogleTest tests in one ctest:
# capped/, caches/, emulated/) in which tests skipped: ctest counts them as passed, so each
# prints an "inner-skipped NAME N" line for the summary.
run_ctest() {
  local dir="$1" rc
  shift
  step ctest ctest --test-dir "$dir" "$@" -j "$JOBS" --output-on-failure --no-tests=error
  rc=$?
  [[ -f $dir/Testing/Temporary/LastTest.log ]] &&
    awk '/^[0-9]+\/[0-9]+ Testing: / { name = $3; next }
         /^\[  SKIPPED \] [0-9]+ tests?[,.]/ { n[name] = $4 }
         /^Test Pass Reason:/ { getline; if ($0 ~ /Skip regular expression/) delete n[name] }
         END { for (k in n) print "inner-skipped " k " " n[k] }' \
      "$dir/Testing/Temporary/LastTest.log" | sort
  return "$rc"
}

run_deps() { step install-deps scripts/install-deps.sh; }

run_format() {
  local files
  files=$(git ls-files '*.cpp' '*.h' '*.inc' 2>/dev/null ||
    find kernels reference property_tests bench -name '*.cpp' -o -name '*.h')
  # shellcheck disable=SC2086
  step clang-format clang-format --dry-run -Werror $files && echo "clang-format: clean"
}

run_native() {
  configure_build "$BUILD_ROOT/build" -DCMAKE_BUILD_TYPE=Release &&
    run_ctest "$BUILD_ROOT/build" -LE emulated
}

run_sanitize() {
  configure_build "$BUILD_ROOT/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=ON &&
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
      run_ctest "$BUILD_ROOT/build-asan"
}

# The emulated runs on the Release build and on a Debug one (emulated/debug-*), where nothing
# is inlined: every header function a kernel file uses is called out of line, so a copy of
# one compiled for an ISA the CPU lacks would trap (cmake/isa.cmake).
run_emulated() {
  configure_build "$BUILD_ROOT/build" -DCMAKE_BUILD_TYPE=Release &&
    run_ctest "$BUILD_ROOT/build" -L emulated &&
    configure_build "$BUILD_ROOT/build-debug" -DCMAKE_BUILD_TYPE=Debug -DMHA_BUILD_BENCH=OFF \
      -DMHA_BUILD_MUTANTS=OFF &&
    run_ctest "$BUILD_ROOT/build-debug" -L emulated
}

# Every test of the cross build runs under qemu-aarch64: idle OpenMP threads sleep rather than
# spin (see property_tests/CMakeLists.txt).
run_aarch64() {
  step setup-aarch64 scripts/setup-aarch64.sh &&
    configure_build "$BUILD_ROOT/build-aarch64" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_TOOLCHAIN_FILE="$REPO/cmake/toolchains/aarch64-linux-gnu.cmake" &&
    OMP_WAIT_POLICY=PASSIVE \
      run_ctest "$BUILD_ROOT/build-aarch64"
}

# The concurrency tests and the driver's properties under ThreadSanitizer: a clang build with
# LLVM's OpenMP runtime and its Archer tool (cmake/tsan.cmake), only their two executables.
run_tsan() {
  local dir="$BUILD_ROOT/build-tsan"
  step --quiet configure cmake -S . -B "$dir" -G Ninja -DMHA_WERROR=ON -DMHA_TSAN=ON \
    -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_BENCH=OFF \
    "${EXTRA_CMAKE_ARGS[@]}" &&
    step build cmake --build "$dir" -j "$JOBS" --target mha_concurrency_test mha_tsan_driver_tests &&
    run_ctest "$dir" -L concurrency
}

# The fuzz targets under clang's libFuzzer with AddressSanitizer + UndefinedBehaviorSanitizer
# (property_tests/fuzz/): a build of their own, then a minute per target (CMake's
# MHA_FUZZ_SECONDS), the targets side by side, each from a temporary copy of its committed
# corpus. Needs no network.
run_fuzz() {
  local rc=0
  CC=clang CXX=clang++ configure_build "$BUILD_ROOT/build-fuzz" -DMHA_FUZZ=ON &&
    run_ctest "$BUILD_ROOT/build-fuzz" -L fuzz ||
    rc=$?
  # What each run did (run.sh's line): inputs, coverage, corpus, crashes.
  grep -h ' inputs in ' "$BUILD_ROOT/build-fuzz/Testing/Temporary/LastTest.log" 2>/dev/null
  return "$rc"
}

# The reports' and the peers' tests. The environment has the reports' packages (small); the
# peers' frameworks (about 5 GB) only where the main job installed them, else their tests
# skip. PyPI out of reach: the part is skipped, and says so.
run_python() {
  local python rc=0
  python=$(scripts/setup-python.sh | tail -n 1) || rc=$?
  if ((rc == 77)); then
    echo "python: skipped (PyPI could not be reached)"
    printf 'PyPI could not be reached' >"$LOGS/reason"
    return 77
  fi
  ((rc == 0)) &&
    (cd reports && step pytest-reports "$python" -m pytest -q -p no:cacheprovider tests) &&
    (cd bench/peers && step pytest-peers "$python" -m pytest -q -p no:cacheprovider -rs tests)
}

run_selftest() { step summary-test scripts/test-summary-test.sh; }

# What each ISA needs, for the list of kernels this CPU could not run: the `needs` column of
# its line in the ISA list, MHA_ISA(name, rank, arch, "needs", detect).
isa_needs() {
  local needs
  needs=$(sed -nE "s/^MHA_ISA\($1, *[0-9]+, *[a-z0-9_]+, *\"([^\"]*)\".*/\1/p" \
    kernels/include/mha/isa.inc)
  echo "needs ${needs:-$1}"
}

# From ctest's "The following tests did not run:" lines of every part: the skipped tests by
# kernel (a test belongs to a kernel when its name ends in /<kernel> or starts with
# copy/<kernel> or <Kernel>Exp.), kernels as registry.inc lists them with their ISA.
not_run_summary() {
  local peers
  peers=$(cat "$LOGS"/part-*.log 2>/dev/null |
    sed -nE 's/^SKIPPED \[[0-9]+\] [^ ]+ (peer-[a-z-]+): .*/\1/p' | sort -u | tr '\n' ' ')
  if [[ -n $peers ]]; then
    echo "peers not tested here (framework not installed; scripts/bench.sh installs them): $peers"
  fi
  local inner
  inner=$(cat "$LOGS"/part-*.log 2>/dev/null |
    sed -nE 's/^inner-skipped ([^ ]+) ([0-9]+)$/\1 (\2)/p' | sort -u | tr '\n' ' ')
  if [[ -n $inner ]]; then
    echo "tests skipped inside whole-binary ctests, which count as passed: $inner"
  fi
  local skipped
  skipped=$(cat "$LOGS"/part-*.log 2>/dev/null |
    sed -nE 's/^[[:space:]]*[0-9]+ - ([^ ]+).*\(Skipped\)$/\1/p')
  [[ -n $skipped ]] || { echo "not run on this CPU: none (every test that started ran)"; return; }
  local kernels name isa n others=$skipped lines=()
  kernels=$(sed -nE 's/^MHA_KERNEL\(([a-z0-9_-]+), *([a-z0-9_]+),.*/\1 \2/p' kernels/registry.inc)
  while read -r name isa; do
    local cap="${name^}"
    local pattern="(/${name//-/_}\$|^copy/${name}\$|^${cap}Exp\.)"
    n=$(grep -c -E "$pattern" <<<"$skipped")
    ((n > 0)) || continue
    lines+=("  $name ($n tests skipped: $(isa_needs "$isa"))")
    others=$(grep -v -E "$pattern" <<<"$others")
  done <<<"$kernels"
  if ((${#lines[@]})); then
    echo "not run on this CPU:"
    printf '%s\n' "${lines[@]}"
  else
    echo "not run on this CPU: no kernel (every kernel of these builds ran)"
  fi
  if [[ -n $others ]]; then
    echo "also skipped by design ($(wc -l <<<"$others")): $(sort -u <<<"$others" | tr '\n' ' ')"
  fi
}

main() {
  total_start=$(date +%s)
  part deps run_deps
  for p in "${PARTS[@]}"; do
    part "$p" "run_$p"
  done
  echo
  echo "=== parts"
  printf '%s\n' "${table[@]}"
  echo "total      $(($(date +%s) - total_start))s"
  echo
  not_run_summary
  echo
  if ((skipped > 0)); then
    echo "tests: $passed passed, $failed failed, $skipped skipped"
  else
    echo "tests: $passed passed, $failed failed"
  fi
  exit $status
}

# Parsed whole before it runs: editing this file during a run cannot break that run. Sourced
# (scripts/test-summary-test.sh), it only defines its functions.
[[ ${BASH_SOURCE[0]} != "$0" ]] || main "$@"

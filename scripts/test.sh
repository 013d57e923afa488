#!/usr/bin/env bash
# Every test of the project, from a fresh Debian 12 machine: installs what it needs, builds,
# and runs the suite natively, under AddressSanitizer + UndefinedBehaviorSanitizer, on
# emulated older x86-64 CPUs (Haswell: AVX2, no AVX-512; qemu64: baseline x86-64) and
# cross-built for aarch64 under qemu. Prints the time of each part and a closing count.
#
# Usage: scripts/test.sh [part ...]   parts: format native sanitize emulated aarch64
#                                     (default: all of them, in that order)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
JOBS="${JOBS:-$(nproc)}"
PARTS=("$@")
((${#PARTS[@]})) || PARTS=(format native sanitize emulated aarch64)

passed=0
failed=0
declare -a timings=()
status=0

# Runs one part, times it, and adds up the ctest counts it printed.
part() {
  local name="$1"
  shift
  local log start end rc
  log="$(mktemp)"
  start=$(date +%s)
  echo "=== $name"
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  end=$(date +%s)
  # ctest: "100% tests passed, 0 tests failed out of 42"
  local line p f total
  while read -r line; do
    f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    p=$((total - f))
    passed=$((passed + p))
    failed=$((failed + f))
  done < <(grep -E 'tests passed, [0-9]+ tests? failed out of' "$log")
  rm -f "$log"
  timings+=("$(printf '%-10s %5ds  %s' "$name" $((end - start)) "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)")")
  if [[ $rc -ne 0 ]]; then status=1; fi
}

configure_build() {  # build_dir, cmake args...
  local dir="$1"
  shift
  cmake -S . -B "$dir" -G Ninja -DMHA_WERROR=ON "$@" >/dev/null && cmake --build "$dir" -j "$JOBS"
}

run_format() {
  local files
  files=$(git ls-files '*.cpp' '*.h' '*.inc' 2>/dev/null || find kernels reference property_tests bench -name '*.cpp' -o -name '*.h')
  # shellcheck disable=SC2086
  clang-format --dry-run -Werror $files && echo "clang-format: clean"
}

run_native() {
  configure_build build -DCMAKE_BUILD_TYPE=Release &&
    ctest --test-dir build -LE emulated -j "$JOBS" --output-on-failure
}

run_sanitize() {
  configure_build build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=ON &&
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
      ctest --test-dir build-asan -j "$JOBS" --output-on-failure
}

run_emulated() {
  configure_build build -DCMAKE_BUILD_TYPE=Release &&
    ctest --test-dir build -L emulated -j "$JOBS" --output-on-failure
}

run_aarch64() {
  scripts/setup-aarch64.sh &&
    configure_build build-aarch64 -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_TOOLCHAIN_FILE="$REPO/cmake/toolchains/aarch64-linux-gnu.cmake" &&
    ctest --test-dir build-aarch64 -j "$JOBS" --output-on-failure
}

total_start=$(date +%s)
part deps scripts/install-deps.sh
for p in "${PARTS[@]}"; do
  case "$p" in
    format) part format run_format ;;
    native) part native run_native ;;
    sanitize) part sanitize run_sanitize ;;
    emulated) part emulated run_emulated ;;
    aarch64) part aarch64 run_aarch64 ;;
    *) echo "unknown part '$p' (parts: format native sanitize emulated aarch64)" >&2; exit 2 ;;
  esac
done
echo
echo "=== time per part"
printf '%s\n' "${timings[@]}"
echo "total      $(($(date +%s) - total_start))s"
echo
echo "tests: $passed passed, $failed failed"
exit $status

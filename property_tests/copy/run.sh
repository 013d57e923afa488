#!/bin/sh
# The copy/<kernel> ctests: README.md's "Copy a kernel", done literally for one kernel. Reads
# the kernel's row of the README's copy table (its files and its flags), copies exactly those
# files (headers of kernels/include/mha/ into mha/), then mha/attention.h and example.cpp into
# an empty folder, builds them with the compiler alone (no CMake, no other file of this project)
# and runs the example. Fails if the compiler prints anything (a copied file must build without
# warnings at -Wall -Wextra).
#
# Usage: run.sh KERNEL REPO WORK_DIR CXX [FLAG...]
#   KERNEL    a kernel name of the table (naive, blocked, avx2, avx512, neon, xsimd-avx2, ...)
#             or of the GEMM table (gemm-portable, gemm-avx2, ...: example gemm_example.cpp)
#   REPO      this repository's root          WORK_DIR  the folder to create (emptied first)
#   CXX       the C++ compiler                FLAG...   added to both commands (the
#                                                       sanitizer build passes its flags)
# Environment: MHA_COPY_RUNNER, a command to run the example with (an emulator for a cross
# build, e.g. "qemu-aarch64 -L /usr/aarch64-linux-gnu"); empty: run it directly.
# Exit status: the example's (0 ok, 77 this CPU lacks the kernel's ISA: ctest reports
# skipped), or 1 if a step fails.
set -eu

kernel=$1
repo=$2
work=$3
cxx=$4
shift 4

fail() {
  echo "copy/$kernel: $*" >&2
  exit 1
}

# Runs one step, echoed; any output from the compiler fails the test.
step() {
  echo "+ $*"
  out=$("$@" 2>&1) || {
    printf '%s\n' "$out"
    exit 1
  }
  if [ -n "$out" ]; then
    printf '%s\n' "$out"
    fail "the compiler printed the above"
  fi
}

# The table row: | `avx2` (x86-64) | `kernels/avx2/avx2.cpp`, `kernels/avx2/avx2_exp.h` | `-mavx2 -mfma` | none |
row=$(grep -E "^\| \`$kernel\`" "$repo/README.md" | head -n 1)
[ -n "$row" ] || fail "no row for $kernel in README.md's copy table"
files=$(printf '%s\n' "$row" | cut -d'|' -f3 | tr -d '`,')
flags=$(printf '%s\n' "$row" | cut -d'|' -f4 | tr -d '`')
# The libraries column's -l options (Highway: -lhwy) go on the link command.
libs=$(printf '%s\n' "$row" | cut -d'|' -f5 | tr -d '`' | grep -o -- '-l[a-z0-9_]*' | tr '\n' ' ')
case "$flags" in *none*) flags="" ;; esac
source=""
for f in $files; do
  [ -f "$repo/$f" ] || fail "README.md names $f, which does not exist"
  case "$f" in *.cpp) source=$(basename "$f") ;; esac
done
[ -n "$source" ] || fail "README.md's row for $kernel names no .cpp file"
object="${source%.cpp}.o"

rm -rf "$work"
mkdir -p "$work/mha"
cp "$repo/kernels/include/mha/attention.h" "$work/mha/"
for f in $files; do
  case "$f" in
    kernels/include/mha/*) cp "$repo/$f" "$work/mha/" ;;
    *) cp "$repo/$f" "$work/" ;;
  esac
done
case "$kernel" in
  gemm-*)  # a GEMM kernel: gemm_example.cpp calls mha_f32_gemm_<name>
    example=gemm_example.cpp
    define="-DMHA_EXAMPLE_GEMM=${kernel#gemm-}"
    ;;
  *)  # an attention kernel: mha_f32_attention_<kernel>, '-' spelled '_' (xsimd-avx2: ..._xsimd_avx2)
    example=example.cpp
    define="-DMHA_EXAMPLE_KERNEL=$(printf '%s' "$kernel" | tr - _)"
    ;;
esac
cp "$repo/property_tests/copy/$example" "$work/"
cd "$work"
# shellcheck disable=SC2086
step "$cxx" -std=c++17 -O2 -Wall -Wextra -I. $flags "$@" -c "$source"
# shellcheck disable=SC2086
step "$cxx" -std=c++17 -O2 -Wall -Wextra -I. "$define" "$@" "$example" "$object" $libs -o example
echo "+ ${MHA_COPY_RUNNER:+$MHA_COPY_RUNNER }./example"
# shellcheck disable=SC2086
exec ${MHA_COPY_RUNNER:-} ./example

#!/bin/sh
# The copy/avx512 ctest: README.md's "Copying a kernel into your project" steps for the
# avx512 kernel, done literally. Copies exactly the files the README names into an empty
# folder, builds them with the compiler alone (no CMake, no other file of this project) and
# runs the example. Fails if the compiler prints anything (a copied file must build without
# warnings at -Wall -Wextra).
#
# Usage: run.sh REPO WORK_DIR CXX [FLAG...]
#   REPO      this repository's root          WORK_DIR  the folder to create (emptied first)
#   CXX       the C++ compiler                FLAG...   added to both commands (the
#                                                       sanitizer build passes its flags)
# Exit status: the example's (0 ok, 77 this CPU lacks AVX-512: ctest reports skipped), or 1
# if a step fails.
set -eu

repo=$1
work=$2
cxx=$3
shift 3

# Runs one step, echoed; any output from the compiler fails the test.
step() {
  echo "+ $*"
  out=$("$@" 2>&1) || {
    printf '%s\n' "$out"
    exit 1
  }
  if [ -n "$out" ]; then
    printf '%s\n' "$out"
    echo "copy/avx512: the compiler printed the above" >&2
    exit 1
  fi
}

rm -rf "$work"
mkdir -p "$work/mha"
cp "$repo/kernels/include/mha/attention.h" "$work/mha/"
cp "$repo/kernels/avx512/avx512.cpp" "$repo/kernels/avx512/avx512_exp.h" \
  "$repo/property_tests/copy/example.cpp" "$work/"
cd "$work"
step "$cxx" -std=c++17 -O2 -Wall -Wextra -I. -mavx512f -mavx512vl -mavx512dq -mavx512bw -mfma \
  "$@" -c avx512.cpp
step "$cxx" -std=c++17 -O2 -Wall -Wextra -I. "$@" example.cpp avx512.o -o example
echo "+ ./example"
exec ./example

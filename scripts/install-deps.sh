#!/usr/bin/env bash
# Installs the Debian 12 packages the project builds, tests and benchmarks with. Runs
# apt-get only for what is missing (as root, or through sudo).
#
# Usage: scripts/install-deps.sh
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build git          # toolchain
  googletest libgtest-dev libgmock-dev librapidcheck-dev   # tests
  libbenchmark-dev libbenchmark-tools             # benchmarks (compare.py)
  libxsimd-dev libhwy-dev                         # portable SIMD kernels
  libopenblas-dev libdnnl-dev                     # composed baselines
  python3-scipy python3-venv                      # compare.py; the reports' and peers' venv
  qemu-user                                       # emulated old x86-64 CPUs and aarch64
  clang-format                                    # style check
  clang libclang-rt-14-dev libomp-dev             # fuzz targets (libFuzzer), ThreadSanitizer (libomp, Archer)
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all packages present"
  exit 0
fi
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo for: ${missing[*]}" >&2; exit 1; }
  SUDO=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"

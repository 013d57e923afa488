# Cross build for aarch64 (NEON, SVE) on an x86-64 Debian host; tests run under qemu-user.
# Prepare the host and the arm64 libraries first with scripts/setup-aarch64.sh, then:
#   cmake -G Ninja -B build-a64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake
#         [-DMHA_AARCH64_ROOT=/path/to/root] [-DMHA_QEMU_CPU=cortex-a76]
# Timings under qemu say nothing about Arm speed: use this for correctness only.

set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Debian's multiarch layout: the packages' libraries and CMake configs are under
# usr/lib/aarch64-linux-gnu, which find_library/find_package only search with this set.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Where scripts/setup-aarch64.sh unpacked the arm64 .debs (default: its own default).
set(MHA_AARCH64_ROOT "${CMAKE_CURRENT_LIST_DIR}/../../.deps/aarch64-root"
    CACHE PATH "Root holding the extracted arm64 Debian packages (scripts/setup-aarch64.sh)")
# qemu CPU model: "max" has SVE2/SVE/NEON; "cortex-a76" is NEON only;
# "max,sve-default-vector-length=32" forces 256-bit SVE.
set(MHA_QEMU_CPU "max" CACHE STRING "CPU model given to qemu-aarch64 -cpu")
# try_compile projects re-read this file without the cache: pass the settings along.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES MHA_AARCH64_ROOT MHA_QEMU_CPU)

get_filename_component(_mha_root "${MHA_AARCH64_ROOT}" ABSOLUTE)
if(NOT EXISTS "${_mha_root}/usr/include/hwy/highway.h")
  message(FATAL_ERROR "No arm64 libraries in ${_mha_root}: run scripts/setup-aarch64.sh "
                      "(or set MHA_AARCH64_ROOT to the directory you gave it).")
endif()

# Libraries, headers and package configs come from the private root (and the cross
# toolchain's own directory), never from the x86-64 host /usr. Programs (compilers' helpers,
# qemu, python) are host programs, hence NEVER.
# No CMAKE_SYSROOT: the root holds only the extracted packages, not libc; the compiler keeps
# its built-in sysroot /usr/aarch64-linux-gnu.
# The packages' CMake configs compute their prefix from their own location
# (CMAKE_CURRENT_LIST_FILE), so imported targets point into the root. They fall back to a
# hard-coded "/usr" only when /usr/lib/aarch64-linux-gnu/cmake/<pkg> on the host is the same
# directory, which cannot happen while no arm64 dpkg architecture is added to the host.
set(CMAKE_FIND_ROOT_PATH "${_mha_root}" /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# binfmt_misc is not mounted on these machines, so test binaries must be started through
# qemu explicitly (add_test, gtest_discover_tests, try_run all honour this).
# -L: qemu looks up the dynamic loader and libc there. Shared libraries from the root
# (libhwy, libbenchmark) are found through the build RPATH CMake writes (qemu falls back to
# the host path when the -L prefixed one does not exist).
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -cpu ${MHA_QEMU_CPU} -L /usr/aarch64-linux-gnu)

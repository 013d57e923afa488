# How code for an ISA is built. Code compiled for an ISA beyond the target's baseline runs
# only after a cpu_supports check. And what a file shares with other objects must be
# baseline code: an inline function of a header or a standard-library template that a file
# uses out of line is compiled into its object as a weak symbol, and the linker keeps one of
# all the objects' copies. A file compiled with -mavx2 makes its copy AVX2 code, which a
# baseline caller may then run: SIGILL on an older CPU, depending on link order, optimization
# level or compiler. So:
#   * The kernels written with intrinsics (avx2, avx512, the GEMMs), their exp tests' eval
#     files and the probe's loops take no flags. Each includes its headers first and then
#     compiles its own code in a target region (MHA_TARGET_BEGIN, kernels/include/mha/
#     support.h): mha_isa_region_sources below. The highway kernel does the same through
#     Highway's pragmas.
#   * The xsimd kernels need the ISA's predefined macros (xsimd picks its architectures by
#     them), so the ISA's flags below (mha_isa_sources), and include every header but xsimd
#     in a baseline region (kernels/xsimd/xsimd_kernel.h).
# The build checks the result: mha_check_isa_symbols below.
#
# The flags of an ISA enable exactly the features its line of kernels/include/mha/isa.inc
# detects at run time. README.md's copy table shows them for the kernels that take them;
# the ctest copy/readme-flags checks it (cmake/check_readme_flags.cmake). GCC and Clang
# spelling. NEON is AArch64's baseline: its list is defined and empty.
set(MHA_ISA_FLAGS_avx2 -mavx2 -mfma -mf16c)
set(MHA_ISA_FLAGS_avx512 -mavx512f -mavx512vl -mavx512dq -mavx512bw -mfma)
set(MHA_ISA_FLAGS_neon "")

# mha_isa_sources(<isa> <file>...): builds the files (of targets in the calling directory)
# with the flags of <isa>, and nothing else with them. Such a file may define no object with
# a dynamic initializer either (see mha_isa_region_sources).
function(mha_isa_sources isa)
  if(NOT DEFINED MHA_ISA_FLAGS_${isa})
    message(FATAL_ERROR "mha_isa_sources: no flags for ISA '${isa}' (cmake/isa.cmake)")
  endif()
  set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS "${MHA_ISA_FLAGS_${isa}}")
  mha_isa_region_sources(${ARGN})
endfunction()

# mha_isa_region_sources(<file>...): files with target regions. Recorded for the ctest
# isa/no-init-code (cmake/check_isa_init.cmake): such a file may define no object with a
# dynamic initializer (a gtest TEST registers one), which would run before main, before any
# CPU check, and which the compiler may build for the file's ISA.
function(mha_isa_region_sources)
  foreach(file IN LISTS ARGN)
    get_filename_component(name ${file} NAME)
    set_property(GLOBAL APPEND PROPERTY MHA_ISA_SOURCE_NAMES ${name})
  endforeach()
endfunction()

# mha_check_isa_symbols(<target>): after <target> is built, cmake/check_isa_symbols.cmake over
# its objects and the kernel library's, which a program linking <target> also links: the
# build fails if a symbol the linker may merge holds code of an ISA other than its other
# copies' (or ISA code under a name that names no ISA). x86-64 only (AArch64's kernels need
# no ISA beyond its baseline; its SVE targets are Highway's, in namespaces of their own).
option(MHA_CHECK_ISA_SYMBOLS "Fail the build when the linker could merge ISA code" ON)
function(mha_check_isa_symbols target)
  if(NOT MHA_CHECK_ISA_SYMBOLS OR NOT CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64"
     OR NOT CMAKE_OBJDUMP OR NOT CMAKE_NM)
    return()
  endif()
  set(objects "$<JOIN:$<TARGET_OBJECTS:${target}>,,>")
  if(NOT target STREQUAL "mha_kernels")
    set(objects "${objects},$<JOIN:$<TARGET_OBJECTS:mha_kernels>,,>")
  endif()
  add_custom_command(TARGET ${target} POST_BUILD
                     COMMAND ${CMAKE_COMMAND} -DOBJDUMP=${CMAKE_OBJDUMP} -DNM=${CMAKE_NM}
                             "-DOBJECTS=${objects}"
                             -P ${PROJECT_SOURCE_DIR}/cmake/check_isa_symbols.cmake
                     VERBATIM)
endfunction()

# The compile flags of each ISA of kernels/include/mha/isa.inc, in one place: the kernels, the
# kernels' exp tests and the benchmark's probe loops take them from here. Each set enables
# exactly the features that the ISA's line of isa.inc detects at run time, so a file built
# with it runs only where cpu_supports says so. README.md's copy table shows the same flags
# to users; the ctest copy/readme-flags checks that it agrees with this file
# (cmake/check_readme_flags.cmake).
#
# GCC and Clang spelling. An ISA that the target has as its baseline needs no flags.
set(MHA_ISA_FLAGS_scalar "")
set(MHA_ISA_FLAGS_sse4 -mssse3 -msse4.1 -msse4.2)
set(MHA_ISA_FLAGS_avx2 -mavx2 -mfma)
set(MHA_ISA_FLAGS_avx512 -mavx512f -mavx512vl -mavx512dq -mavx512bw -mfma)
set(MHA_ISA_FLAGS_avx512icl -mavx512f -mavx512vl -mavx512dq -mavx512bw -mavx512vbmi
    -mavx512vbmi2 -mavx512bitalg -mavx512vpopcntdq -mvaes -mvpclmulqdq -mavxvnni -mfma)
set(MHA_ISA_FLAGS_neon "")  # Advanced SIMD is mandatory in AArch64
set(MHA_ISA_FLAGS_sve -march=armv8.2-a+sve)
set(MHA_ISA_FLAGS_sve2 -march=armv8.5-a+sve2)
# sse4, avx512icl, sve and sve2 are the Highway kernel's targets, which Highway compiles with
# its own pragmas: no file of the project uses these flags yet.

# mha_isa_sources(<isa> <file>...): builds the files (of targets in the calling directory)
# with the flags of <isa>, and nothing else with them: code compiled with an ISA's flags may
# use its instructions anywhere, so only files whose code runs after a cpu_supports check
# may have them. That excludes static constructors, which run before main: such a file must
# define no object with a dynamic initializer (a gtest TEST registers one), and the ctest
# isa/no-init-code checks that no initialization code of its object uses a vector
# instruction.
function(mha_isa_sources isa)
  if(NOT DEFINED MHA_ISA_FLAGS_${isa})
    message(FATAL_ERROR "mha_isa_sources: unknown ISA '${isa}' (cmake/isa.cmake)")
  endif()
  if(MHA_ISA_FLAGS_${isa})
    set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS "${MHA_ISA_FLAGS_${isa}}")
    # For the ctest isa/no-init-code (cmake/check_isa_init.cmake): the file names.
    foreach(file IN LISTS ARGN)
      get_filename_component(name ${file} NAME)
      set_property(GLOBAL APPEND PROPERTY MHA_ISA_SOURCE_NAMES ${name})
    endforeach()
  endif()
endfunction()

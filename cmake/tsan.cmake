# MHA_TSAN: the library and the concurrency tests under ThreadSanitizer (scripts/test.sh tsan).
#
# GCC's OpenMP runtime (libgomp) synchronises its threads in code ThreadSanitizer does not
# see, so every value handed to a parallel region reads as a race. clang links LLVM's
# runtime (libomp) instead, and its OMPT tool Archer (libarcher.so, in Debian's
# libomp-<version>-dev beside libomp.so) tells ThreadSanitizer about OpenMP's barriers,
# tasks and locks; property_tests/concurrency/ loads it through OMP_TOOL_LIBRARIES.
option(MHA_TSAN "Build with ThreadSanitizer (needs clang: LLVM's OpenMP runtime and Archer)" OFF)
if(MHA_TSAN)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "MHA_TSAN needs clang (-DCMAKE_CXX_COMPILER=clang++): with GCC the "
                        "OpenMP runtime is libgomp, whose synchronisation ThreadSanitizer "
                        "cannot see")
  endif()
  if(MHA_SANITIZE)
    message(FATAL_ERROR "MHA_TSAN and MHA_SANITIZE exclude each other (one sanitizer runtime)")
  endif()
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
endif()

# cmake -DOBJDUMP=<objdump> -DROOT=<build dir> -DNAMES=<a.cpp,b.cpp,...> -P check_isa_init.cmake
#
# Code in a target region may use that ISA's instructions anywhere (cmake/isa.cmake), and a
# static constructor runs before main, before any cpu_supports check: one that the compiler
# built for the ISA kills the program with SIGILL on a CPU without it. (An exp test built
# whole with the AVX-512 flags did: under the sanitizers its gtest registration poisoned the
# stack's shadow with zmm stores, and the test executable died on AVX2-only CPUs before it
# could list its tests.) So every object of the files NAMES (the ones with target regions)
# below ROOT must have no C++ dynamic initializer (_GLOBAL__sub_I_...) and no
# other initialization function (a sanitizer's module constructor, _sub_I_...) with a vector
# instruction: a VEX or EVEX mnemonic (v...) or a ymm, zmm or mask register.
string(REPLACE "," ";" names "${NAMES}")
set(errors "")
set(checked 0)
foreach(name IN LISTS names)
  file(GLOB_RECURSE objects "${ROOT}/${name}.o")
  if(NOT objects)
    string(APPEND errors "  ${name}: no object file below ${ROOT} (built?)\n")
  endif()
  foreach(object IN LISTS objects)
    execute_process(COMMAND ${OBJDUMP} -d --no-show-raw-insn ${object}
                    OUTPUT_VARIABLE listing RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      string(APPEND errors "  ${object}: objdump failed\n")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    string(REPLACE ";" "," listing "${listing}")
    string(REPLACE "\n" ";" lines "${listing}")
    set(function "")
    foreach(line IN LISTS lines)
      if(line MATCHES "^[0-9a-f]+ <([^>]+)>:$")
        set(function "${CMAKE_MATCH_1}")
        if(function MATCHES "^_GLOBAL__sub_I_")
          string(APPEND errors "  ${object}: a static constructor (${function})\n")
        endif()
      elseif(function MATCHES "_sub_I_" AND
             line MATCHES "\t(v[a-z0-9]+ |.*%[yz]mm|.*%k[0-7])")
        string(STRIP "${line}" instruction)
        string(APPEND errors "  ${object}: ${function}: ${instruction}\n")
      endif()
    endforeach()
  endforeach()
endforeach()
if(errors)
  message(FATAL_ERROR "initialization code in files with target regions:\n${errors}")
endif()
message(STATUS "isa/no-init-code: ${checked} objects of ${NAMES}: no ISA code before main")

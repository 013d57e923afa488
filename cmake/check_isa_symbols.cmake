# cmake -DOBJDUMP=<objdump> -DNM=<nm> -DOBJECTS=<a.o,b.o,...> -P check_isa_symbols.cmake
#
# No code compiled for one ISA may serve a call made under another. An inline function, a
# template instantiation or a static member of a header is emitted as a weak (COMDAT) symbol
# in every object that uses it out of line, and the linker keeps one copy, whichever it meets
# first. If one of those copies was compiled for AVX2 and the linker keeps it, baseline code
# calls AVX2 instructions: SIGILL on a CPU without them, in a build that differs only in its
# link order, its optimization level or its compiler.
#
# So, over the objects OBJECTS (x86-64), each weak function symbol's code is classified by the
# instructions it uses beyond baseline x86-64: sse3, sse4 (SSSE3 to SSE4.2), bmi (BMI1/2,
# LZCNT, POPCNT, MOVBE), avx (a VEX mnemonic or a ymm register) and avx512 (a zmm, mask or
# upper-16 vector register). A symbol whose name names no ISA (avx, sse, fma, neon, sve, or
# Highway's per-target namespaces N_...) is shared code: an inline function of mha/support.h,
# a template of the standard library, which any object may call. The check fails when such a
# symbol holds ISA code in any object:
#   * "compiled for different ISAs": its copies differ, and the linker may keep either;
#   * "<class> code under a name that names no ISA": its only copies here hold ISA code,
#     which a user's object (another kernel copied beside this one) would share.
# A symbol that names its ISA (a member of Attention<xsimd::avx2>, mha::avx2::exp2_nonpositive,
# hwy::N_AVX2::...) is called only from code of that ISA; its copies may use more or less of
# it.
# Weak data symbols hold no code and are not checked.
string(REPLACE "," ";" objects "${OBJECTS}")
# Each class and what shows it in objdump's AT&T listing: a register, or a mnemonic (at a
# tab, as objdump prints it; SSE2's own pminsw, pextrw and the like do not match).
set(isas avx512 avx sse4 sse3 bmi)
set(shows_avx512 "%zmm|%k[1-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])")
set(shows_avx "\tv[a-z0-9]+([ \n]|$)|%ymm")
set(shows_sse4 "\t(pshufb|ph(add|sub)s?[wd]|pmaddubsw|pmulhrsw|psign[bwd]|pabs[bwd]|palignr|p?blendv?p?[sdbw]|dpp[sd]|extractps|insertps|pextr[bdq]|pinsr[bdq]|pmov[sz]x|pmuldq|pmulld|pm(in|ax)(sb|sd|uw|ud)|phminposuw|ptest|pcmp(eq|gt)q|pcmp[ei]str[im]|packusdw|movntdqa|round[ps][sd]|crc32)[bwlq]?[ \n]")
set(shows_sse3 "\t(h(add|sub)p[sd]|addsubp[sd]|movddup|movs[hl]dup|lddqu)[ \n]")
set(shows_bmi "\t(popcnt|lzcnt|tzcnt|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx|movbe)[bwlq]?[ \n]")
set(checked 0)
set(symbols "")
foreach(object IN LISTS objects)
  execute_process(COMMAND ${NM} --defined-only -P ${object} OUTPUT_VARIABLE table
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${object}: nm failed")
  endif()
  string(REGEX MATCHALL "[^\n]+ W [^\n]*" weak "${table}")
  if(NOT weak)
    continue()
  endif()
  foreach(entry IN LISTS weak)
    string(REGEX REPLACE " W .*" "" name "${entry}")
    set("weak:${object}:${name}" 1)
  endforeach()
  execute_process(COMMAND ${OBJDUMP} -d --no-show-raw-insn ${object} OUTPUT_VARIABLE listing
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${object}: objdump failed")
  endif()
  math(EXPR checked "${checked} + 1")
  # One list element per function: objdump separates them with an empty line.
  string(REGEX REPLACE "[][;]" "," listing "${listing}")
  string(REPLACE "\n\n" ";" blocks "${listing}")
  foreach(block IN LISTS blocks)
    if(NOT block MATCHES "^[0-9a-f]+ <([^>]+)>:")
      continue()
    endif()
    set(name "${CMAKE_MATCH_1}")
    if(NOT DEFINED "weak:${object}:${name}")
      continue()
    endif()
    set(class "")
    foreach(isa IN LISTS isas)
      if(block MATCHES "${shows_${isa}}")
        list(APPEND class ${isa})
      endif()
    endforeach()
    list(JOIN class "+" class)
    if(NOT class)
      set(class baseline)
    endif()
    if(NOT DEFINED "cls.${name}")
      list(APPEND symbols "${name}")
    endif()
    list(APPEND "cls.${name}" "${class}")
    list(APPEND "where.${name}" "${class} in ${object}")
  endforeach()
endforeach()

set(errors "")
set(count 0)
foreach(name IN LISTS symbols)
  set(classes ${cls.${name}})
  list(REMOVE_DUPLICATES classes)
  list(LENGTH classes n)
  set(problem "")
  if(name MATCHES "[Aa][Vv][Xx]|[Ss][Ss][Ee]|[Ff][Mm][Aa]|[Nn][Ee][Oo][Nn]|[Ss][Vv][Ee]|N_[A-Z0-9_]+"
     OR classes STREQUAL "baseline")
    continue()
  elseif(n GREATER 1)
    set(problem "compiled for different ISAs")
  else()
    set(problem "${classes} code under a name that names no ISA")
  endif()
  if(problem)
    math(EXPR count "${count} + 1")
    execute_process(COMMAND c++filt "${name}" OUTPUT_VARIABLE pretty
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT pretty)
      set(pretty "${name}")
    endif()
    string(APPEND errors "  ${pretty}: ${problem}\n")
    foreach(where IN LISTS where.${name})
      string(APPEND errors "      ${where}\n")
    endforeach()
  endif()
endforeach()
if(errors)
  message(FATAL_ERROR "${count} weak symbols the linker may merge hold ISA code that another "
                      "object's call could run (cmake/check_isa_symbols.cmake):\n${errors}")
endif()

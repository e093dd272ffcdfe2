# tests/docs_check.cmake: the committed reference pages against their one
# source each, run with cmake -P:
#   config/SETTINGS.md, config/idemq.cfg.5  from the settings table (config/conf.c)
#   consumer/idemq.1                        from consumer/idemq.1.in and `idemq --help`
# -DMODE=check  (ctest docs_current): fail, with a diff, when a committed file
#               differs from what idemq-docs prints now;
# -DMODE=write  (cmake --build build --target docs): regenerate them in place;
# -DMODE=lint   (ctest docs_man_lint): the committed man pages format with no
#               warning (groff -z -ww -man; mandoc -Tlint too when installed).
# Other variables: TOOL (idemq-docs), IDEMQ (the binary), SRC (source tree),
# OUT (a scratch directory).
cmake_minimum_required(VERSION 3.18)

set(pages config/SETTINGS.md config/idemq.cfg.5 consumer/idemq.1)
set(regen "cmake --build <build dir> --target docs")

if(MODE STREQUAL "lint")
  find_program(GROFF groff REQUIRED)
  find_program(MANDOC mandoc)
  set(problems "")
  foreach(page config/idemq.cfg.5 consumer/idemq.1)
    execute_process(COMMAND ${GROFF} -z -ww -man ${SRC}/${page}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0 OR NOT "${out}${err}" STREQUAL "")
      string(APPEND problems "groff -z -ww -man ${page} (exit ${rc}):\n${out}${err}\n")
    endif()
    if(MANDOC)
      execute_process(COMMAND ${MANDOC} -Tlint -Wwarning ${SRC}/${page}
                      RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
      if(NOT rc EQUAL 0 OR NOT "${out}${err}" STREQUAL "")
        string(APPEND problems "mandoc -Tlint ${page} (exit ${rc}):\n${out}${err}\n")
      endif()
    endif()
  endforeach()
  if(problems)
    message(FATAL_ERROR "man pages do not format cleanly:\n${problems}")
  endif()
  message(STATUS "man pages format with no warning")
  return()
endif()

file(MAKE_DIRECTORY ${OUT})
execute_process(COMMAND ${IDEMQ} --help OUTPUT_FILE ${OUT}/usage.txt RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${IDEMQ} --help failed (${rc})")
endif()
execute_process(COMMAND ${TOOL} settings md OUTPUT_FILE ${OUT}/SETTINGS.md RESULT_VARIABLE rc1)
execute_process(COMMAND ${TOOL} settings man OUTPUT_FILE ${OUT}/idemq.cfg.5 RESULT_VARIABLE rc2)
execute_process(COMMAND ${TOOL} cli-man ${SRC}/consumer/idemq.1.in INPUT_FILE ${OUT}/usage.txt
                OUTPUT_FILE ${OUT}/idemq.1 RESULT_VARIABLE rc3)
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0 OR NOT rc3 EQUAL 0)
  message(FATAL_ERROR "idemq-docs failed (settings md: ${rc1}, settings man: ${rc2}, "
                      "cli-man: ${rc3})")
endif()

set(stale "")
foreach(page ${pages})
  get_filename_component(name ${page} NAME)
  if(MODE STREQUAL "write")
    execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}/${name} ${SRC}/${page})
    continue()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${SRC}/${page} ${OUT}/${name}
                  RESULT_VARIABLE differ)
  if(differ)
    execute_process(COMMAND diff -u ${SRC}/${page} ${OUT}/${name} OUTPUT_VARIABLE d)
    string(APPEND stale "${page} differs from what its source gives now:\n${d}\n")
  endif()
endforeach()
if(stale)
  message(FATAL_ERROR "${stale}"
          "The settings table (config/conf.c), the usage text (consumer/main.c) or "
          "consumer/idemq.1.in changed without the generated pages: regenerate them with\n"
          "    ${regen}\nand commit config/SETTINGS.md, config/idemq.cfg.5 and consumer/idemq.1.")
endif()
if(MODE STREQUAL "write")
  message(STATUS "regenerated: ${pages}")
else()
  message(STATUS "committed pages match the settings table and the usage text")
endif()

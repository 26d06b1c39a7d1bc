# Helpers so each concept folder declares itself in two lines:
#   loom_library(data DEPS loom_core)      -> static lib loom_data from *.cpp in the folder
#   loom_tests(data DEPS loom_data)        -> gtest binary loom_data_tests from tests/*.cpp
#   loom_tests(train DEPS loom_train MULTIRANK "Trainer*:..." SERIAL "Watchdog.*")
#                                          -> the tests matching MULTIRANK launch ranks as processes
#                                          (label "multirank"); those matching SERIAL are unit tests
#                                          that time themselves or use several threads
# All targets reuse one precompiled header (torch + std). With LOOM_UNITY_BUILD (the default) each
# target's sources compile in unity batches: the 700 MB header is loaded once per batch instead of
# once per file, which is most of what a Loom source file costs to compile (see docs/building.md).

# The multi-rank and serial tests of a gtest binary, each its own ctest test: labelled with its
# `kind` (unit or multirank) and its folder. They take both cores (PROCESSORS 2), so `ctest -j 2`
# runs any of them alone, and two of the single-threaded unit suites (loom_discover_suites) at a time.
function(loom_discover_tests target folder kind filter processors)
  # One label "<kind>.<folder>" (e.g. unit.fsdp, multirank.train): gtest_discover_tests cannot pass a
  # list of labels through its generated scripts, and ctest -L takes a regular expression, so
  # `ctest -L unit` and `ctest -L fsdp` both select by it.
  # LOOM_CACHE_DIR: the token cache (training.token_cache) in the build folder, so a test run
  # neither reads nor fills the user's ~/.cache/loom.
  set(props LABELS "${kind}.${folder}" ENVIRONMENT "OMP_NUM_THREADS=1" PROCESSORS ${processors}
      ENVIRONMENT_MODIFICATION "LOOM_CACHE_DIR=set:${CMAKE_BINARY_DIR}/cache")
  # Discovery runs the binary at test time, so ctest sees every TEST() as its own test.
  # NO_PRETTY_VALUES: a parameterised test is named by its parameter's name alone (…/tp2).
  gtest_discover_tests(${target} DISCOVERY_MODE PRE_TEST TEST_FILTER "${filter}" NO_PRETTY_VALUES
                       PROPERTIES ${props})
endfunction()

# The single-threaded unit tests of a gtest binary, one ctest test per GoogleTest suite
# ("<Suite>.*", label unit.<folder>): a process per suite rather than per test, since each process
# pays ~0.3 s to load libtorch and the suite has hundreds of sub-second unit tests. The list is
# written when the binary is built (cmake/gtest_suites.cmake) and read by ctest.
function(loom_discover_suites target folder filter)
  set(ctest_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} "-DTEST_EXECUTABLE=$<TARGET_FILE:${target}>" "-DTEST_FILTER=${filter}"
            "-DCTEST_FILE=${ctest_file}" "-DLABEL=unit.${folder}" "-DCACHE_DIR=${CMAKE_BINARY_DIR}/cache"
            -P ${CMAKE_SOURCE_DIR}/cmake/gtest_suites.cmake
    BYPRODUCTS ${ctest_file} VERBATIM)
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  file(WRITE "${include_file}"
       "if(EXISTS \"${ctest_file}\")\n  include(\"${ctest_file}\")\nelse()\n"
       "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()

function(loom_library name)
  cmake_parse_arguments(A "" "" "DEPS" ${ARGN})
  file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  list(FILTER srcs EXCLUDE REGEX "/pch\\.cpp$")  # loom_pch's own source, compiled there once
  add_library(loom_${name} STATIC ${srcs})
  target_include_directories(loom_${name} PUBLIC ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(loom_${name} PUBLIC ${A_DEPS})
  target_precompile_headers(loom_${name} REUSE_FROM loom_pch)
endfunction()

# MULTIRANK and SERIAL: gtest filters (patterns joined by ':'); the tests that match neither are
# single-threaded unit tests.
function(loom_tests name)
  cmake_parse_arguments(A "" "MULTIRANK;SERIAL" "DEPS" ${ARGN})
  file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tests/*.cpp)
  if(NOT srcs)
    return()
  endif()
  add_executable(loom_${name}_tests ${srcs})
  target_link_libraries(loom_${name}_tests PRIVATE ${A_DEPS} loom_gtest_main)
  target_precompile_headers(loom_${name}_tests REUSE_FROM loom_pch)
  set(others "")
  if(A_MULTIRANK)
    loom_discover_tests(loom_${name}_tests ${name} multirank "${A_MULTIRANK}" 2)
    set(others "${A_MULTIRANK}")
  endif()
  if(A_SERIAL)
    loom_discover_tests(loom_${name}_tests ${name} unit "${A_SERIAL}" 2)
    if(others)
      set(others "${others}:${A_SERIAL}")
    else()
      set(others "${A_SERIAL}")
    endif()
  endif()
  if(others)
    loom_discover_suites(loom_${name}_tests ${name} "-${others}")
  else()
    loom_discover_suites(loom_${name}_tests ${name} "*")
  endif()
endfunction()

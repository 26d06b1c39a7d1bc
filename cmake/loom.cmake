# Helpers so each concept folder declares itself in two lines:
#   loom_library(data DEPS loom_core)      -> static lib loom_data from *.cpp in the folder
#   loom_tests(data DEPS loom_data)        -> gtest binary loom_data_tests from tests/*.cpp
# All targets reuse one precompiled header (torch + std) so a TU costs seconds, not tens of them.

function(loom_library name)
  cmake_parse_arguments(A "" "" "DEPS" ${ARGN})
  file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  add_library(loom_${name} STATIC ${srcs})
  target_include_directories(loom_${name} PUBLIC ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(loom_${name} PUBLIC ${A_DEPS})
  if(NOT name STREQUAL "core")
    target_precompile_headers(loom_${name} REUSE_FROM loom_pch)
  endif()
endfunction()

function(loom_tests name)
  cmake_parse_arguments(A "" "" "DEPS" ${ARGN})
  file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tests/*.cpp)
  if(NOT srcs)
    return()
  endif()
  add_executable(loom_${name}_tests ${srcs})
  target_link_libraries(loom_${name}_tests PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main)
  target_precompile_headers(loom_${name}_tests REUSE_FROM loom_pch)
  # Discovery runs the binary at test time, so ctest sees every TEST() as its own test.
  gtest_discover_tests(loom_${name}_tests DISCOVERY_MODE PRE_TEST
    PROPERTIES LABELS ${name} ENVIRONMENT "OMP_NUM_THREADS=1")
endfunction()

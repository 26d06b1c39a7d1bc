# Run after a test binary is built (cmake -P, from loom_discover_suites in cmake/loom.cmake): lists
# the binary's tests matching TEST_FILTER and writes CTEST_FILE, one ctest test per GoogleTest
# suite ("<Suite>.*"), run by one process with --gtest_filter=<Suite>.*[-<excluded>].
# Inputs: TEST_EXECUTABLE, TEST_FILTER (a gtest filter: "*" or "-<excluded patterns>"), CTEST_FILE,
# LABEL, CACHE_DIR (LOOM_CACHE_DIR for the tests).
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests "--gtest_filter=${TEST_FILTER}"
                OUTPUT_VARIABLE listing RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}):\n${listing}")
endif()
set(excluded "")
if(TEST_FILTER MATCHES "^-(.*)$")
  set(excluded "-${CMAKE_MATCH_1}")
endif()
string(REPLACE ";" "" listing "${listing}")  # a parameter's printed value could hold one
string(REPLACE "\n" ";" lines "${listing}")
set(content "")
foreach(line IN LISTS lines)
  # A suite line: "Suite." (a typed suite adds "  # TypeParam = ..."); test lines are indented.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content
      "add_test([=[${suite}.*]=] \"${TEST_EXECUTABLE}\" [=[--gtest_filter=${suite}.*${excluded}]=])\n"
      "set_tests_properties([=[${suite}.*]=] PROPERTIES LABELS ${LABEL} PROCESSORS 1"
      " ENVIRONMENT OMP_NUM_THREADS=1 ENVIRONMENT_MODIFICATION [=[LOOM_CACHE_DIR=set:${CACHE_DIR}]=])\n")
  endif()
endforeach()
file(WRITE "${CTEST_FILE}" "${content}")

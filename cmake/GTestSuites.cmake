# scaletrain_discover_suites(target
#     [EACH_TEST suite...]          suites whose tests get a ctest entry each
#     [RUN_SERIAL pattern...]       tests (regular expressions on Suite.Test) that run alone
#     [ONE_AT_A_TIME pattern...]    tests of EACH_TEST suites that never run beside each other
#                                   (one RESOURCE_LOCK), though beside any other test
#     [PROPERTIES name value...]    properties of every entry
#     [NUMERIC_FILE file])          entries to run again under each CPU dispatch level below the
#                                   machine's own ("include REGEX" / "exclude REGEX" lines)
#
# Registers a GoogleTest program with CTest by suite: every suite is one entry, `Suite.*`, that
# runs the suite's tests in one process (`--gtest_filter=Suite.*`). A process that includes
# LibTorch spends about half a second of processor time registering its operators before main(),
# more than most tests take: one process per test made that start the biggest single cost of
# `make test` (docs/build.md). Suites of long tests, where the start is nothing and a suite in one
# process would be one long pole among two cores, are listed in EACH_TEST and get an entry per
# test, named as gtest_discover_tests names them (`Prefix/Suite.Test/param`). Tests named
# *_CUDA get an entry each, labelled "cuda" and skipped (not failed) where no GPU is visible.
#
# The list comes from the built program (--gtest_list_tests), after each build, as CMake's own
# gtest_discover_tests does: a new test or suite is run without a line here. A batch that selects
# no test fails rather than passing empty.
#
# The entries NUMERIC_FILE selects are written again as `isa-<level>/<entry>`, for each CPU
# dispatch level below the machine's own (`default`, and `avx2` on an AVX-512 machine), with
# ATen, oneDNN and MKL capped at that level (Note [Tolerances] in tests/support/tolerance.h): one
# `ctest` then runs them beside the others, and two cores stay busy to its end.
function(scaletrain_discover_suites target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "NUMERIC_FILE" "EACH_TEST;RUN_SERIAL;ONE_AT_A_TIME;PROPERTIES")
  set(base "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites")
  # The arguments travel in a file: suite names and patterns keep their characters.
  # (file(CONFIGURE) writes only a change: the program is linked and listed again after one.)
  set(script "${PROJECT_SOURCE_DIR}/cmake/GTestSuitesDiscover.cmake")
  file(CONFIGURE OUTPUT "${base}_arguments.cmake" CONTENT
    "set(each_test [==[${arg_EACH_TEST}]==])\nset(run_serial [==[${arg_RUN_SERIAL}]==])
set(one_at_a_time [==[${arg_ONE_AT_A_TIME}]==])
set(properties [==[${arg_PROPERTIES}]==])\nset(numeric_file [==[${arg_NUMERIC_FILE}]==])\n")
  set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS "${base}_arguments.cmake" "${script}"
    ${arg_NUMERIC_FILE})
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}" "-DPROGRAM=$<TARGET_FILE:${target}>" "-DBASE=${base}"
      -P "${script}"
    BYPRODUCTS "${base}_tests.cmake"
    VERBATIM)
  # Until a build has listed the tests there is nothing to run: a test that says so fails.
  file(WRITE "${base}_include.cmake"
    "if(EXISTS [==[${base}_tests.cmake]==])\n"
    "  include([==[${base}_tests.cmake]==])\n"
    "else()\n"
    "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${base}_include.cmake")
endfunction()

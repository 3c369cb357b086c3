# Small helpers so every folder's CMakeLists.txt reads the same way.
#
#   mainstay_cc_library(NAME layout SRCS layout.cc DEPS mainstay::status absl::statusor)
#     -> static library mainstay_layout, alias mainstay::layout
#   mainstay_cc_test(NAME layout_test SRCS layout_test.cc DEPS mainstay::layout LABELS unit)
#     -> GoogleTest binary registered with CTest under the given labels
#   mainstay_cc_binary(NAME mainstayctl SRCS main.cc DEPS mainstay::cli)

set(MAINSTAY_WARNINGS -Wall -Wextra -Werror -Wno-unused-parameter)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  # GCC-only warning names in `#pragma GCC diagnostic` (e.g. -Wdangling-pointer) are not errors.
  list(APPEND MAINSTAY_WARNINGS -Wno-unknown-warning-option)
endif()

function(mainstay_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${MAINSTAY_WARNINGS}>)
endfunction()

function(mainstay_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(mainstay_${A_NAME} STATIC ${A_SRCS})
  add_library(mainstay::${A_NAME} ALIAS mainstay_${A_NAME})
  target_include_directories(mainstay_${A_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(mainstay_${A_NAME} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  mainstay_warnings(mainstay_${A_NAME})
endfunction()

function(mainstay_cc_binary)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  mainstay_warnings(${A_NAME})
endfunction()

# LABELS: unit, integration, gpu, slow (any combination). A gpu test binary calls
# GTEST_SKIP() when no device is present and has the main of tests/testing/gtest_skip_main.cc,
# which exits 77 when every case skipped: CTest then reports it as skipped, not passed, and a
# run where some case failed still fails.
function(mainstay_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ARGS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  if("gpu" IN_LIST A_LABELS)
    set(A_MAIN mainstay_gtest_skip_main)
  else()
    set(A_MAIN GTest::gtest_main)
  endif()
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} mainstay::testing GTest::gmock ${A_MAIN})
  mainstay_warnings(${A_NAME})
  add_test(NAME ${A_NAME} COMMAND ${A_NAME} ${A_ARGS})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set_tests_properties(${A_NAME} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT})
  if("gpu" IN_LIST A_LABELS)
    set_tests_properties(${A_NAME} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endfunction()

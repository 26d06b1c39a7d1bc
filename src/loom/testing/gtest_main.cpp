// The test binaries' main: GoogleTest's, except that the process ends with _exit once the tests
// have run and their output is flushed. A normal exit runs libtorch's static destructors, which
// deregister every operator kernel: ~0.15 s of CPU per process on the CI machine, paid by each of
// the suite's ~650 test processes for nothing (apps/main.cpp ends `loom` the same way).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const int code = RUN_ALL_TESTS();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(code);
}

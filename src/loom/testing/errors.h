// Test support: assert that a call fails with a one-line loom::Error naming the problem.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loom/core/error.h"

namespace loom::testing {

// Expects `fn` to throw loom::Error whose message is one line and contains every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected loom::Error";
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& p : parts) {
      EXPECT_NE(message.find(p), std::string::npos) << message << " lacks " << p;
    }
  }
}

}  // namespace loom::testing

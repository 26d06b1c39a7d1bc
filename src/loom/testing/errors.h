// Test support: assert that a call fails with a one-line loom::Error naming the problem.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

#include "loom/core/error.h"

namespace loom::testing {

// Expects `fn` to throw loom::Error (or the subclass `E`, e.g. loom::UsageError for exit code 2)
// whose message is one line and contains every one of `parts`.
template <typename E = loom::Error, typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected " << typeid(E).name();
  } catch (const E& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& p : parts) {
      EXPECT_NE(message.find(p), std::string::npos) << message << " lacks " << p;
    }
  }
}

// The message of the loom::UsageError that `fn` throws, or "<no UsageError>".
inline std::string usage_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const loom::UsageError& e) {
    return e.what();
  }
  return "<no UsageError>";
}

}  // namespace loom::testing

#include <gtest/gtest.h>
#include <torch/torch.h>
namespace elementwise_kernels_test {}

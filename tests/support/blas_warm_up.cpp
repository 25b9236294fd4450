// Runs a small matrix product and tanh, forward and backward, before any test. The first
// such computation of a process occasionally rounds differently from every later one
// (measured: about 1 process in 20 on a 2-core machine, none with one thread, none after
// this warm-up; MKL sets itself up on first use). A reference computed first would then
// differ in the last bits from the same computation a moment later, and a test comparing
// them bitwise would fail for no fault of the code under test.
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

class BlasWarmUp : public testing::Environment {
 public:
  void SetUp() override {
    const at::Tensor weight = at::ones({128, 128}).requires_grad_();
    at::tanh(at::mm(at::ones({64, 128}), weight)).sum().backward();
  }
};

const testing::Environment* const kBlasWarmUp = testing::AddGlobalTestEnvironment(new BlasWarmUp);

}  // namespace

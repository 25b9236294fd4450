// Activation recomputation against plain LibTorch running the same function without it:
// outputs and gradients must match bit for bit, the region must really run again in
// backward, and what the options promise (random draws replayed, activations not kept,
// a changed rerun reported, early stop) must hold.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "error_of.h"
#include "hyperparallel/recompute.h"

namespace hp {

// Found by gtest through ADL, so it lives beside RecomputeImpl: CTest names each
// parameterized test after this (ctest -R NonReentrant).
void PrintTo(RecomputeImpl impl, std::ostream* out) {
  *out << (impl == RecomputeImpl::kNonReentrant ? "NonReentrant" : "Reentrant");
}

namespace {

struct Mlp {
  torch::nn::Linear fc1{8, 16};
  torch::nn::Linear fc2{16, 4};
  at::Tensor operator()(const at::Tensor& x) { return torch::tanh(fc2(torch::gelu(fc1(x)))); }
  std::vector<at::Tensor> parameters() { return {fc1->weight, fc1->bias, fc2->weight, fc2->bias}; }
};

struct Result {
  at::Tensor output;
  std::vector<at::Tensor> grads;  // one per leaf, in the leaves' order
};

// Runs forward, backpropagates sum(output^2) `backward_calls` times through the same
// graph, and takes the leaves' gradients, leaving them cleared for the next run.
Result run(const std::vector<at::Tensor>& leaves, const std::function<at::Tensor()>& forward,
           int backward_calls = 1) {
  Result result;
  result.output = forward();
  const at::Tensor loss = result.output.pow(2).sum();
  for (int i = 0; i < backward_calls; ++i) {
    loss.backward({}, /*retain_graph=*/i + 1 < backward_calls);
  }
  result.output = result.output.detach();
  for (const auto& leaf : leaves) {
    result.grads.push_back(leaf.grad());
    leaf.mutable_grad().reset();
  }
  return result;
}

void expect_equal(const Result& actual, const Result& expected) {
  EXPECT_TRUE(torch::equal(actual.output, expected.output));
  ASSERT_EQ(actual.grads.size(), expected.grads.size());
  for (size_t i = 0; i < actual.grads.size(); ++i) {
    SCOPED_TRACE("leaf " + std::to_string(i));
    ASSERT_TRUE(expected.grads[i].defined());
    ASSERT_TRUE(actual.grads[i].defined());
    EXPECT_TRUE(torch::equal(actual.grads[i], expected.grads[i]));
  }
}

std::vector<at::Tensor> with_input(const at::Tensor& x, std::vector<at::Tensor> parameters) {
  parameters.insert(parameters.begin(), x);
  return parameters;
}

using testing::error_of;

class Recompute : public ::testing::TestWithParam<RecomputeImpl> {
 protected:
  RecomputeOptions options(bool preserve_rng_state = true) const {
    return {.impl = GetParam(), .preserve_rng_state = preserve_rng_state};
  }
};

INSTANTIATE_TEST_SUITE_P(Impl, Recompute,
                         ::testing::Values(RecomputeImpl::kNonReentrant,
                                           RecomputeImpl::kReentrant));

TEST_P(Recompute, OutputAndGradientsMatchPlainLibTorch) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const Result expected = run(leaves, [&] { return mlp(x); });
  const Result actual = run(leaves, [&] {
    return recompute([&](const at::Tensor& in) { return mlp(in); }, x, options());
  });
  expect_equal(actual, expected);
}

TEST_P(Recompute, RegionRunsAgainOnceInBackward) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  int calls = 0;
  const auto counted = [&](const at::Tensor& in) {
    ++calls;
    return mlp(in);
  };
  const at::Tensor y = recompute(counted, x, options());
  EXPECT_EQ(calls, 1);
  y.sum().backward();
  EXPECT_EQ(calls, 2);

  calls = 0;
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(recompute(counted, x, options()).requires_grad());
  EXPECT_EQ(calls, 1);
}

TEST_P(Recompute, DropoutMasksAreReplayedAndTheGeneratorContinues) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const auto block = [&](const at::Tensor& in) {
    return mlp.fc2(torch::dropout(torch::gelu(mlp.fc1(in)), 0.5, /*train=*/true));
  };
  // A draw between forward and backward tells "restored to after the forward" apart
  // from "continued from where backward found it".
  at::Tensor between, after;
  const auto seeded_run = [&](const std::function<at::Tensor()>& forward) {
    torch::manual_seed(7);
    return run(leaves, [&] {
      at::Tensor y = forward();
      between = torch::rand({16});
      return y;
    });
  };

  const Result expected = seeded_run([&] { return block(x); });
  const at::Tensor expected_after = torch::rand({16});
  const at::Tensor expected_between = between;

  const Result replayed = seeded_run([&] { return recompute(block, x, options()); });
  expect_equal(replayed, expected);
  EXPECT_TRUE(torch::equal(torch::rand({16}), expected_after));
  EXPECT_TRUE(torch::equal(between, expected_between));

  // Without the replay the rerun draws other masks: the option is not ignored.
  const Result redrawn = seeded_run([&] { return recompute(block, x, options(false)); });
  EXPECT_TRUE(torch::equal(redrawn.output, expected.output));
  EXPECT_FALSE(torch::equal(redrawn.grads[0], expected.grads[0])) << "input grad";
  EXPECT_FALSE(torch::equal(redrawn.grads[3], expected.grads[3])) << "fc2 weight grad";
}

TEST_P(Recompute, OneTensorFormMatchesVectorForm) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const Result vector_form = run(leaves, [&] {
    return recompute(
        [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{mlp(in[0])}; }, {x},
        options())[0];
  });
  const Result tensor_form = run(leaves, [&] {
    return recompute([&](const at::Tensor& in) { return mlp(in); }, x, options());
  });
  expect_equal(tensor_form, vector_form);
}

TEST_P(Recompute, SeveralInputsAndOutputs) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const at::Tensor z = torch::randn({5, 16}).requires_grad_();
  auto leaves = with_input(x, mlp.parameters());
  leaves.push_back(z);
  // Both outputs feed the loss, each through its own path back to x and z.
  const auto block = [&](const std::vector<at::Tensor>& in) {
    const at::Tensor h = torch::tanh(mlp.fc1(in[0])) * in[1];
    return std::vector<at::Tensor>{mlp.fc2(h), h.sum(1)};
  };
  const auto combine = [](const std::vector<at::Tensor>& out) {
    return out[0] * out[1].unsqueeze(1);
  };
  const Result expected = run(leaves, [&] { return combine(block({x, z})); });
  const Result actual = run(leaves, [&] { return combine(recompute(block, {x, z}, options())); });
  expect_equal(actual, expected);
}

TEST_P(Recompute, ActivationsAreNotKeptAfterForward) {
  torch::manual_seed(0);
  const at::Tensor w = (torch::randn({256, 256}) / 16).requires_grad_();
  const at::Tensor x = torch::randn({256, 256}).requires_grad_();
  constexpr int kLayers = 8;
  // The storages of the intermediate activations (not the returned last one), watched
  // without keeping them alive.
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> activations;
  bool watch = true;
  const auto chain = [&](const at::Tensor& in) {
    at::Tensor h = in;
    for (int i = 0; i < kLayers; ++i) {
      if (i > 0 && watch) activations.push_back(h.storage().getWeakStorageImpl());
      h = torch::tanh(h.matmul(w));
    }
    return h;
  };
  const auto live_bytes = [&] {
    size_t bytes = 0;
    for (const auto& storage : activations) {
      if (const auto alive = storage.lock()) bytes += alive->nbytes();
    }
    return bytes;
  };

  // Plain autograd keeps every intermediate for backward: the measure sees them.
  const Result expected = run({x, w}, [&] {
    at::Tensor y = chain(x);
    watch = false;
    EXPECT_EQ(live_bytes(), (kLayers - 1) * 256 * 256 * sizeof(float));
    return y;
  });

  activations.clear();
  watch = true;
  const Result actual = run({x, w}, [&] {
    at::Tensor y = recompute(chain, x, options());
    watch = false;
    EXPECT_EQ(activations.size(), static_cast<size_t>(kLayers - 1));
    EXPECT_EQ(live_bytes(), 0u);
    return y;
  });
  expect_equal(actual, expected);
}

TEST(RecomputeNonReentrant, AutogradGradMatches) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto grads_of = [&](const at::Tensor& y) {
    return torch::autograd::grad({y.pow(2).sum()}, {x, mlp.fc1->weight});
  };
  const auto expected = grads_of(mlp(x));
  const auto actual = grads_of(recompute([&](const at::Tensor& in) { return mlp(in); }, x));
  ASSERT_EQ(actual.size(), 2u);
  EXPECT_TRUE(torch::equal(actual[0], expected[0]));
  EXPECT_TRUE(torch::equal(actual[1], expected[1]));
  EXPECT_FALSE(mlp.fc1->weight.grad().defined()) << "grad() must not accumulate";
}

TEST(RecomputeNonReentrant, InputWithoutGradStillGivesParameterGradients) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8});
  const auto leaves = mlp.parameters();
  const Result expected = run(leaves, [&] { return mlp(x); });
  const Result actual =
      run(leaves, [&] { return recompute([&](const at::Tensor& in) { return mlp(in); }, x); });
  expect_equal(actual, expected);
}

TEST(RecomputeNonReentrant, NestedRecompute) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const auto inner = [&](const at::Tensor& in) { return torch::gelu(mlp.fc1(in)); };
  const Result expected = run(leaves, [&] { return torch::tanh(mlp.fc2(inner(x))); });
  const Result actual = run(leaves, [&] {
    return recompute(
        [&](const at::Tensor& in) { return torch::tanh(mlp.fc2(recompute(inner, in))); }, x);
  });
  expect_equal(actual, expected);
}

TEST(RecomputeNonReentrant, BackwardTwiceThroughARetainedGraph) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const Result once = run(leaves, [&] { return mlp(x); });
  const Result expected = run(leaves, [&] { return mlp(x); }, 2);
  const Result actual =
      run(leaves, [&] { return recompute([&](const at::Tensor& in) { return mlp(in); }, x); }, 2);
  expect_equal(actual, expected);
  for (size_t i = 0; i < once.grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual.grads[i], 2 * once.grads[i])) << "leaf " << i;
  }
}

TEST(RecomputeNonReentrant, RerunThatSavesOtherTensorsIsReported) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  bool changed = false;
  // The rerun sees fewer rows: what it saves for backward has another shape.
  const at::Tensor y = recompute(
      [&](const at::Tensor& in) { return mlp(changed ? in.narrow(0, 0, 2) : in).sum(0); }, x);
  changed = true;
  const std::string what = error_of([&] { y.sum().backward(); });
  EXPECT_NE(what.find("recomputed"), std::string::npos) << "what(): " << what;
}

// Early stop: the rerun ends once it has saved the forward's last saved tensor, here the
// input of fc2, which addmm saves before it computes; what follows runs in forward only.
TEST(RecomputeNonReentrant, EarlyStopSkipsWhatFollowsTheLastSavedTensor) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  int tail_runs = 0;
  const auto region = [&](const at::Tensor& in) {
    at::Tensor out = mlp.fc2(torch::gelu(mlp.fc1(in)));
    ++tail_runs;
    return out + 1;  // saves nothing
  };
  const Result expected = run(leaves, [&] { return region(x); });
  for (std::optional<bool> early_stop :
       {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
    SCOPED_TRACE("early_stop " + (early_stop ? std::to_string(*early_stop) : "unset"));
    tail_runs = 0;
    const Result actual =
        run(leaves, [&] { return recompute(region, x, {.early_stop = early_stop}); });
    expect_equal(actual, expected);
    EXPECT_EQ(tail_runs, early_stop.value_or(true) ? 1 : 2);
  }
}

// The outer region's last saved tensor is the inner region's input: the outer rerun stops
// before the inner region runs, and the inner one reruns in its own backward.
TEST(RecomputeNonReentrant, EarlyStopBeforeANestedRegion) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  int inner_runs = 0;
  const auto inner = [&](const at::Tensor& in) {
    ++inner_runs;
    return mlp.fc2(in);
  };
  const auto outer = [&](const at::Tensor& in) {
    return recompute(inner, torch::gelu(mlp.fc1(in)));
  };
  const Result expected = run(leaves, [&] { return mlp.fc2(torch::gelu(mlp.fc1(x))); });
  for (bool early_stop : {true, false}) {
    SCOPED_TRACE(early_stop ? "early stop" : "whole outer rerun");
    inner_runs = 0;
    const Result actual =
        run(leaves, [&] { return recompute(outer, x, {.early_stop = early_stop}); });
    expect_equal(actual, expected);
    EXPECT_EQ(inner_runs, early_stop ? 2 : 3);  // forward, (outer rerun,) inner rerun
  }
}

TEST(RecomputeNonReentrant, ARegionThatSwallowsTheStopIsReported) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto leaves = with_input(x, mlp.parameters());
  const auto swallowing = [&](const at::Tensor& in) {
    at::Tensor out;
    try {
      out = mlp(in);
    } catch (...) {  // swallows everything, the stop included
    }
    return out;
  };
  const at::Tensor y = recompute(swallowing, x);
  const std::string what = error_of([&] { y.sum().backward(); });
  EXPECT_NE(what.find("early_stop = false"), std::string::npos) << "what(): " << what;
  // Without early stop the region reruns whole and nothing is thrown through it.
  const Result expected = run(leaves, [&] { return mlp(x); });
  expect_equal(run(leaves, [&] { return recompute(swallowing, x, {.early_stop = false}); }),
               expected);
}

TEST(RecomputeReentrant, EarlyStopIsRefused) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const auto block = [&](const at::Tensor& in) { return mlp(in); };
  const RecomputeOptions stopping{.impl = RecomputeImpl::kReentrant, .early_stop = true};
  EXPECT_NE(error_of<c10::ValueError>([&] { recompute(block, x, stopping); }).find("early_stop"),
            std::string::npos);
  EXPECT_TRUE(recompute(block, x, {.impl = RecomputeImpl::kReentrant, .early_stop = false})
                  .requires_grad());
}

TEST(RecomputeReentrant, AutogradGradIsRefused) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8}).requires_grad_();
  const at::Tensor y = recompute([&](const at::Tensor& in) { return mlp(in); }, x,
                                 {.impl = RecomputeImpl::kReentrant});
  const std::string what = error_of([&] { torch::autograd::grad({y.sum()}, {x}); });
  EXPECT_NE(what.find("reentrant"), std::string::npos) << "what(): " << what;
}

TEST(RecomputeReentrant, NeedsAnInputThatRequiresGrad) {
  torch::manual_seed(0);
  Mlp mlp;
  const at::Tensor x = torch::randn({5, 8});
  const auto block = [&](const at::Tensor& in) { return mlp(in); };
  const RecomputeOptions reentrant{.impl = RecomputeImpl::kReentrant};
  EXPECT_THROW(recompute(block, x, reentrant), c10::ValueError);
  // Without autograd there is no backward to miss the parameters.
  torch::NoGradGuard no_grad;
  EXPECT_NO_THROW(recompute(block, x, reentrant));
}

}  // namespace
}  // namespace hp

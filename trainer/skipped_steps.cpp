#include "trainer/skipped_steps.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "hyperparallel/collectives.h"

namespace hp::trainer {

std::pair<double, bool> SkippedSteps::decide(const StepResult& result, int64_t step,
                                             const Job& job) {
  at::Tensor values = torch::stack({result.loss.detach().to(torch::kCPU, torch::kFloat),
                                    torch::scalar_tensor(std::isfinite(result.grad_norm) ? 0 : 1)});
  hp::all_reduce(values, hp::ReduceOp::kAvg, job.all()).wait();
  const double loss = values[0].item<double>();
  if (std::isfinite(loss) && values[1].item<double>() == 0) {
    in_a_row_ = 0;
    return {loss, true};
  }
  ++in_a_row_;
  ++total_;
  if (rank_ == 0) {
    std::fprintf(stderr,
                 "train_decoder: step %lld skipped (no update): loss %g, gradient norm %g, "
                 "not finite on some rank; %lld in a row, %lld in all\n",
                 static_cast<long long>(step), loss, result.grad_norm,
                 static_cast<long long>(in_a_row_), static_cast<long long>(total_));
  }
  if (in_a_row_ >= limit_) {
    C10_THROW_ERROR(Error, "--max-skipped-steps " + std::to_string(limit_) + ": steps " +
                               std::to_string(step - in_a_row_ + 1) + " to " +
                               std::to_string(step) +
                               " all had a non-finite loss or gradient norm; lower --lr "
                               "(or raise --warmup), or check the data");
  }
  return {loss, false};
}

}  // namespace hp::trainer

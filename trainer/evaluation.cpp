#include "trainer/evaluation.h"

#include <torch/torch.h>

#include <algorithm>

#include "hyperparallel/collectives.h"

namespace hp::trainer {

double validation_loss(const LossOf& loss_of, const std::vector<Batch>& batches,
                       const hp::Group& all) {
  torch::NoGradGuard no_grad;
  at::Tensor sums = torch::zeros({2}, torch::kDouble);  // loss sum, bytes
  for (const auto& batch : batches) {
    const std::pair<at::Tensor, int64_t> loss = loss_of(batch);
    if (loss.second == 0) continue;
    const int64_t bytes = loss.second;
    sums[0] += loss.first.item<double>() * static_cast<double>(bytes);
    sums[1] += static_cast<double>(bytes);
  }
  hp::all_reduce(sums, hp::ReduceOp::kSum, all).wait();
  return (sums[0] / sums[1]).item<double>();
}

std::string generate(const NextLogits& next_logits, const std::string& prompt, int64_t length,
                     int64_t context, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator generator = at::detail::createCPUGenerator(seed);
  std::vector<int64_t> tokens;
  for (char c : prompt) tokens.push_back(static_cast<unsigned char>(c));
  if (tokens.empty()) tokens.push_back('\n');
  std::string text;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
    const at::Tensor input =
        torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end())).unsqueeze(0);
    const at::Tensor logits = next_logits(input).to(at::kCPU, at::kFloat) / 0.8;
    const auto [top, index] = logits.topk(8);
    const int64_t pick =
        torch::multinomial(torch::softmax(top, 0), 1, false, generator).item<int64_t>();
    const int64_t byte = index[pick].item<int64_t>();
    tokens.push_back(byte);
    text += static_cast<char>(byte);
  }
  return text;
}

std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? c : '?';
  return out;
}

}  // namespace hp::trainer

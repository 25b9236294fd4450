#include "device_choice.h"

#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#ifdef HP_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <torch/cuda.h>
#endif

namespace hp::detail {

std::optional<int64_t> own_cuda_index(int64_t local_rank, int64_t device_count) {
  if (device_count == 1) return 0;
  if (local_rank < device_count) return local_rank;
  return std::nullopt;
}

std::optional<std::string> why_not_all_on_gpus(const std::vector<SeenDevice>& ranks) {
  for (const SeenDevice& seen : ranks) {
    if (!seen.cuda_index) {
      return "rank " + std::to_string(seen.rank) + " has no GPU of its own (" + seen.context + ")";
    }
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = i + 1; j < ranks.size(); ++j) {
      if (ranks[i].gpu == ranks[j].gpu) {
        return "ranks " + std::to_string(ranks[i].rank) + " and " + std::to_string(ranks[j].rank) +
               " would share one GPU (" + ranks[i].gpu + "; " + ranks[i].context + "; " +
               ranks[j].context + ")";
      }
    }
  }
  return std::nullopt;
}

namespace {

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

#ifdef HP_WITH_NCCL
std::string gpu_uuid(int64_t index) {
  const cudaDeviceProp* properties = at::cuda::getDeviceProperties(index);
  static const char* digits = "0123456789abcdef";
  std::string text = "GPU-";
  for (char byte : properties->uuid.bytes) {
    text += digits[(static_cast<unsigned char>(byte) >> 4) & 15];
    text += digits[static_cast<unsigned char>(byte) & 15];
  }
  return text;
}
#endif

}  // namespace

SeenDevice see_device(int64_t rank, int64_t local_rank) {
  SeenDevice seen;
  seen.rank = rank;
  int64_t count = 0;
#ifdef HP_WITH_NCCL
  if (torch::cuda::is_available()) count = static_cast<int64_t>(torch::cuda::device_count());
  seen.cuda_index = own_cuda_index(local_rank, count);
  if (seen.cuda_index) seen.gpu = host_name() + " " + gpu_uuid(*seen.cuda_index);
#endif
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::ostringstream context;
  context << "LOCAL_RANK " << local_rank << ", " << count
          << " CUDA device(s) visible, CUDA_VISIBLE_DEVICES ";
  if (visible) {
    context << "'" << visible << "'";
  } else {
    context << "unset";
  }
  context << ", host " << host_name();
  seen.context = context.str();
  return seen;
}

std::string encode(const SeenDevice& seen) {
  nlohmann::json json{{"rank", seen.rank}, {"gpu", seen.gpu}, {"context", seen.context}};
  if (seen.cuda_index) json["cuda_index"] = *seen.cuda_index;
  return json.dump();
}

SeenDevice decode(const std::string& text) {
  const nlohmann::json json = nlohmann::json::parse(text);
  SeenDevice seen;
  seen.rank = json.at("rank").get<int64_t>();
  seen.gpu = json.at("gpu").get<std::string>();
  seen.context = json.at("context").get<std::string>();
  if (json.contains("cuda_index")) seen.cuda_index = json.at("cuda_index").get<int64_t>();
  return seen;
}

}  // namespace hp::detail

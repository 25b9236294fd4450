// Forward outputs through hp::Sharded: built with HP_MAP_OUTPUT or HP_STRUCT_OUTPUT it
// must fail to compile with fully_shard's message (tensors in those types would get no
// pre-backward hook); built without, the supported containers must compile.
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hyperparallel/fully_shard.h"

#if defined(HP_MAP_OUTPUT)
using Output = std::map<std::string, at::Tensor>;
Output make_output(const at::Tensor& x) { return {{"y", x}}; }
#elif defined(HP_STRUCT_OUTPUT)
struct Output {
  at::Tensor y;
};
Output make_output(const at::Tensor& x) { return {x}; }
#else
using Output = std::tuple<at::Tensor, std::vector<std::optional<at::Tensor> >,
                          std::pair<int64_t, std::string> >;
Output make_output(const at::Tensor& x) { return {x, {x, std::nullopt}, {1, "one"}}; }
#endif

struct BlockImpl : torch::nn::Module {
  Output forward(const at::Tensor& x) { return make_output(x); }
};
TORCH_MODULE(Block);

Output call(hp::Sharded<Block>& block, const at::Tensor& x) { return block(x); }

#include "model_params.h"

#include <c10/util/Exception.h>

#include "hyperparallel/process_group.h"

namespace hp::detail {

std::vector<ModelParam> model_params(torch::nn::Module& model) {
  std::vector<ModelParam> params;
  for (const auto& item : model.named_parameters()) {
    ModelParam param{item.key(), item.value(), sharded_parameter_of(item.value()), std::nullopt,
                     item.value().sizes().vec()};
    if (param.shard) param.whole_shape = param.shard->global_shape();
    param.parallel_slice = parallel_slice_of(item.value());
    if (param.parallel_slice) {
      param.whole_shape[param.parallel_slice->dim] *= param.parallel_slice->group->size();
    }
    params.push_back(std::move(param));
  }
  return params;
}

at::Tensor whole_of(const ModelParam& p, const at::Tensor& slice) {
  return p.parallel_slice ? join_parallel_slices(slice, *p.parallel_slice) : slice;
}

at::Tensor slice_of_whole(const ModelParam& p, const at::Tensor& whole) {
  return p.parallel_slice ? slice_of(whole, *p.parallel_slice) : whole;
}

bool writes_whole_tensors(torch::nn::Module& model) {
  const std::vector<ModelParam> params = model_params(model);
  for (const ModelParam& p : params) {
    if (p.parallel_slice && p.parallel_slice->group->rank() != 0) return false;
  }
  for (const ModelParam& p : params) {
    if (p.shard) return p.shard->data_parallel_group().rank() == 0;
  }
  return true;
}

void require_sharded(const ShardedParameter& p, const std::string& name, const char* caller) {
  if (p.is_unsharded()) {
    C10_THROW_ERROR(Error, std::string(caller) + ": parameter '" + name +
                               "' is unsharded now (between a forward and its backward?); call "
                               "it between steps, or reshard() first");
  }
}

}  // namespace hp::detail

#include "sharded_param_index.h"

#include <stdexcept>

#include "fsdp_param_group.h"
#include "fsdp_state.h"
#include "state_registry.h"

namespace hp::detail {

std::map<const c10::TensorImpl*, ShardedParam> index_sharded_params() {
  std::map<const c10::TensorImpl*, ShardedParam> found;
  for (const auto& state : all_states()) {
    FSDPParamGroup& param_group = state->param_group();
    for (const auto& p : param_group.params()) {
      found[p->variable().unsafeGetTensorImpl()] = {p.get(), &param_group.mesh_info()};
    }
  }
  return found;
}

std::vector<ModelParam> model_params(torch::nn::Module& model) {
  const auto sharded = index_sharded_params();
  std::vector<ModelParam> params;
  for (const auto& item : model.named_parameters()) {
    ModelParam param{item.key(), item.value(), std::nullopt, std::nullopt,
                     item.value().sizes().vec()};
    auto it = sharded.find(item.value().unsafeGetTensorImpl());
    if (it != sharded.end()) {
      param.shard = it->second;
      param.whole_shape = it->second.param->layout().global_shape;
    }
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
    if (p.shard) return p.shard->mesh_info->data_parallel->rank() == 0;
  }
  return true;
}

void require_sharded(const ShardedParam& p, const std::string& name, const char* caller) {
  if (p.param->is_unsharded()) {
    throw std::logic_error(std::string(caller) + ": parameter '" + name +
                           "' is unsharded now (between a forward and its backward?); call "
                           "it between steps, or reshard() first");
  }
}

}  // namespace hp::detail

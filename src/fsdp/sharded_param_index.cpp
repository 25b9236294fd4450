#include "sharded_param_index.h"

#include <stdexcept>

#include "fsdp_state.h"
#include "state_registry.h"

namespace hp::detail {

std::map<const c10::TensorImpl*, ShardedParam> index_sharded_params() {
  std::map<const c10::TensorImpl*, ShardedParam> found;
  for (const auto& state : all_states()) {
    ParamGroup& group = state->group();
    for (const auto& p : group.params()) {
      found[p->variable().unsafeGetTensorImpl()] = {p.get(), group.comm().shard.get()};
    }
  }
  return found;
}

void require_sharded(const ShardedParam& p, const std::string& name, const char* caller) {
  if (p.param->is_unsharded()) {
    throw std::logic_error(std::string(caller) + ": parameter '" + name +
                           "' is unsharded now (between a forward and its backward?); call "
                           "it between steps, or reshard() first");
  }
}

}  // namespace hp::detail

#pragma once
// Finds the fully_shard bookkeeping of a parameter variable, for the functions that take
// a plain module (state dicts).

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace hp {
class Group;
}

namespace hp::detail {

class FSDPParam;

struct ShardedParam {
  FSDPParam* param;
  const Group* shard_group;
};

// Every sharded parameter of every live fully_shard state, by its variable's TensorImpl.
std::map<const c10::TensorImpl*, ShardedParam> index_sharded_params();

// Throws std::logic_error naming `caller` when the parameter holds unsharded data now.
void require_sharded(const ShardedParam& p, const std::string& name, const char* caller);

}  // namespace hp::detail

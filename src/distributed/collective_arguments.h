#pragma once
// Argument checks shared by the collectives and the quantized collectives: each names the
// collective, the offending tensor and the fix, as a c10::ValueError.

#include <ATen/core/Tensor.h>

#include <string>

#include "hyperparallel/process_group.h"

namespace hp::detail {

void require(bool condition, const std::string& message);

void require_contiguous(const at::Tensor& tensor, const char* op, const char* what);

struct NamedTensor {
  const at::Tensor& tensor;
  const char* name;
};

// `whole` (contiguous) has group size x `part`'s elements, of `part`'s dtype: the two
// sides of an all-gather or a reduce-scatter. `hint` ends the message.
void require_group_multiple(const char* op, NamedTensor whole, NamedTensor part, const Group& group,
                            const std::string& hint);

}  // namespace hp::detail

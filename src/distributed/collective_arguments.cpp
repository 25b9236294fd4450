#include "collective_arguments.h"

#include <c10/util/Exception.h>

namespace hp::detail {

void require(bool condition, const std::string& message) {
  if (!condition) C10_THROW_ERROR(ValueError, message);
}

void require_contiguous(const at::Tensor& tensor, const char* op, const char* what) {
  require(tensor.defined(), std::string(op) + ": " + what + " is undefined");
  require(tensor.is_contiguous(),
          std::string(op) + ": " + what + " must be contiguous (call .contiguous())");
}

void require_group_multiple(const char* op, NamedTensor whole, NamedTensor part, const Group& group,
                            const std::string& hint) {
  require_contiguous(whole.tensor, op, whole.name);
  require_contiguous(part.tensor, op, part.name);
  require(whole.tensor.numel() == part.tensor.numel() * group.size() &&
              whole.tensor.scalar_type() == part.tensor.scalar_type(),
          std::string(op) + ": " + whole.name + " must have group size (" +
              std::to_string(group.size()) + ") x " + part.name + " numel (" +
              std::to_string(part.tensor.numel()) + ") elements of the " + part.name + "'s dtype" +
              hint + "; got " + std::to_string(whole.tensor.numel()));
}

}  // namespace hp::detail

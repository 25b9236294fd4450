#pragma once
// A run the options (or the files they name) rule out before it starts: main reports it
// as "train_decoder: <what> (see --help)" and exits with status 2, as for a bad flag.

#include <stdexcept>

namespace hp::trainer {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace hp::trainer

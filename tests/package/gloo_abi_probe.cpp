// Makes the compiler lay out c10d's Gloo store adapter (a gloo::rendezvous::Store) from
// the Gloo headers this build uses, and emit its vtable into this object file;
// check_gloo_headers.sh compares that vtable with the one in LibTorch's library, which was
// compiled against the Gloo LibTorch was built with. A different size means the headers
// declare other virtual functions than LibTorch's Gloo (see third_party/gloo/README.md).
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

std::unique_ptr<gloo::rendezvous::Store> hp_gloo_abi_probe() {
  return std::make_unique<c10d::ProcessGroupGloo::GlooStore>(
      c10::make_intrusive<c10d::HashStore>());
}

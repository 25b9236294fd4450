// Runs as one rank: joins a world of one, builds a mesh and all-reduces with avg.
#include <ATen/ATen.h>
#include <hyperparallel/collectives.h>
#include <hyperparallel/mesh.h>

#include <cstdio>

int main() {
  hp::DeviceMesh mesh = hp::DeviceMesh::from_env({{"dp", 1}});
  at::Tensor x = at::arange(4, at::kFloat);
  hp::all_reduce(x, hp::ReduceOp::kAvg, *mesh.group("dp")).wait();
  if (!at::equal(x, at::arange(4, at::kFloat))) return 1;
  std::printf("consumer ok: mesh of %lld rank(s)\n", static_cast<long long>(mesh.size()));
  return 0;
}

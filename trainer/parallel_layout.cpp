#include "trainer/parallel_layout.h"

#include <stdexcept>
#include <string>

namespace hp::trainer {
namespace {

DeviceMesh trainer_mesh(const std::shared_ptr<World>& world, const TrainOptions& o) {
  check_world_size(o, world->size());
  return DeviceMesh(world, {{"pp", o.pp},
                            {"dp_replicate", o.replicate},
                            {"dp_shard", o.shard / o.ep},
                            {"ep", o.ep},
                            {"cp", o.cp},
                            {"tp", o.tp}});
}

}  // namespace

void check_world_size(const TrainOptions& o, int64_t world_size) {
  const int64_t ranks = o.pp * o.replicate * o.shard * o.cp * o.tp;
  if (ranks != world_size) {
    throw std::invalid_argument(
        (o.pp > 1 ? "--pp " + std::to_string(o.pp) + " x " : std::string()) + "--mesh " + o.mesh +
        " x --cp " + std::to_string(o.cp) + " x --tp " + std::to_string(o.tp) + " needs " +
        std::to_string(ranks) + " ranks, this run has " + std::to_string(world_size) +
        " (use hp-run -n " + std::to_string(ranks) + ", or change the degrees)");
  }
}

ParallelLayout make_parallel_layout(const std::shared_ptr<World>& world, const TrainOptions& o) {
  DeviceMesh mesh = trainer_mesh(world, o);
  mesh.flatten({"dp_shard", "ep", "cp"}, "dp_shard_ep_cp");
  mesh.flatten({"dp_shard", "cp"}, "dp_shard_cp");
  const bool replicated = o.replicate > 1;
  ParallelLayout layout{.mesh = mesh,
                        .pipeline = mesh.group("pp"),
                        .tensor_parallel = mesh.group("tp"),
                        .context_parallel = mesh.group("cp"),
                        .expert_parallel = mesh.group("ep"),
                        .data_rank = (mesh.coordinate("dp_replicate") * (o.shard / o.ep) +
                                      mesh.coordinate("dp_shard")) *
                                         o.ep +
                                     mesh.coordinate("ep"),
                        .data_ranks = o.replicate * o.shard,
                        .dense_mesh = replicated ? mesh.slice({"dp_replicate", "dp_shard_ep_cp"})
                                                 : mesh.slice({"dp_shard_ep_cp"}),
                        .experts_mesh = replicated ? mesh.slice({"dp_replicate", "dp_shard_cp"})
                                                   : mesh.slice({"dp_shard_cp"}),
                        .experts_divide_factor = static_cast<double>(o.replicate * o.shard * o.cp)};
  return layout;
}

void shard_block(Sharded<models::DecoderBlock>& block, const FullyShardOptions& options,
                 const ParallelLayout& layout) {
  if (block->moe) {
    FullyShardOptions experts_options = options;
    experts_options.mesh = layout.experts_mesh;
    fully_shard(block->moe->experts, experts_options)
        .set_gradient_divide_factor(layout.experts_divide_factor);
  }
  fully_shard(block, options);
}

}  // namespace hp::trainer

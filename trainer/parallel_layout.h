#pragma once
// How the trainer's ranks divide the work, on one mesh
//   {pp, dp_replicate R, dp_shard S / ep, ep, cp, tp}   (--pp, --mesh RxS, --ep, --cp, --tp)
// (torchtitan's layout): pp ranks hold different stages of the model and read the same
// batches; ranks that differ in dp_replicate, dp_shard or ep read different
// batches; cp splits each sequence; tp splits heads, FFN units and the vocabulary. The
// dense parameters are fully_shard-ed over dp_shard x ep x cp (replicated over
// dp_replicate), the experts over dp_shard x cp (orthogonal to ep, which splits them).

#include <cstdint>
#include <memory>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/mesh.h"
#include "models/transformer.h"
#include "trainer/train_options.h"

namespace hp::trainer {

struct ParallelLayout {
  DeviceMesh mesh;
  GroupPtr pipeline;  // the ranks that differ only in their stage
  GroupPtr tensor_parallel, context_parallel, expert_parallel;
  int64_t data_rank = 0;    // which share of every global batch this rank reads ...
  int64_t data_ranks = 1;   // ... of this many
  DeviceMesh dense_mesh;    // fully_shard's mesh for all but the experts
  DeviceMesh experts_mesh;  // fully_shard's mesh for the experts
  // The experts' gradient divide factor: each already sums what every ep rank's tokens
  // contributed, so it is divided by all the data x context ranks (R x S x cp).
  double experts_divide_factor = 1;
};

// Throws std::invalid_argument naming the options when the degrees do not multiply to
// `world_size`. Checked before joining the World too (LaunchEnv's WORLD_SIZE), so that every
// rank stops before any connection: a rank that stops while another still connects turns
// the usage error into a connection error there.
void check_world_size(const TrainOptions& o, int64_t world_size);

// Throws std::invalid_argument naming the options when the degrees do not multiply to the
// world's size.
ParallelLayout make_parallel_layout(const std::shared_ptr<World>& world, const TrainOptions& o);

// fully_shards a decoder block with `options` (the dense mesh), an MoE block's experts
// first, over the layout's experts mesh with its divide factor.
void shard_block(Sharded<models::DecoderBlock>& block, const FullyShardOptions& options,
                 const ParallelLayout& layout);

}  // namespace hp::trainer

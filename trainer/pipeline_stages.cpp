#include "trainer/pipeline_stages.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "hyperparallel/clip_grad.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/tensor_parallel.h"

namespace hp::trainer {
namespace {

// Activations sent between stages outside the schedule (forward only) travel after a
// record of their shape and dtype: [ndim, dims..., dtype].
constexpr int64_t kMaxDims = 4;

int boundary_tag(int64_t stage, int64_t part) { return static_cast<int>(2 * stage + part); }

// The modules of `chunks` registered under their names in the whole decoder, in its order;
// `tied_copy`: the last stage's copy of the tied embedding too.
std::shared_ptr<torch::nn::Module> whole_named_part(
    const std::vector<Sharded<DecoderStage>>& chunks, bool tied_copy) {
  auto part = std::make_shared<torch::nn::Module>();
  for (const auto& chunk : chunks) {
    if (chunk->first || (chunk->last && tied_copy)) {
      part->register_module("tok_embeddings", chunk->whole->tok_embeddings);
    }
    if (chunk->first) part->register_module("pos_embeddings", chunk->whole->pos_embeddings);
  }
  auto layers = part->register_module("layers", std::make_shared<torch::nn::Module>());
  for (const auto& chunk : chunks) {
    for (size_t i = 0; i < chunk->layers.size(); ++i) {
      layers->register_module(std::to_string(chunk->layer_indices[i]), chunk->layers[i].ptr());
    }
    if (chunk->last) part->register_module("norm", chunk->whole->norm);
  }
  return part;
}

}  // namespace

at::Tensor next_byte_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                   const GroupPtr& tensor_parallel) {
  return vocab_parallel_cross_entropy(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                      target.reshape(-1), tensor_parallel);
}

DecoderStageImpl::DecoderStageImpl(models::Transformer& whole, int64_t stage, int64_t stages)
    : first(stage == 0), last(stage == stages - 1), whole(whole) {
  const int64_t per_stage = whole->config.layers / stages;
  if (first || last) register_module("tok_embeddings", whole->tok_embeddings);
  if (first) register_module("pos_embeddings", whole->pos_embeddings);
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
    layers.push_back(whole->layers[i]);
    layer_indices.push_back(i);
    list->push_back(layers.back().ptr());
  }
  if (last) register_module("norm", whole->norm);
}

at::Tensor DecoderStageImpl::forward(const at::Tensor& x) {
  at::Tensor h = x;
  if (first) h = whole->embed(x);
  aux_loss = torch::zeros({}, h.options().dtype(at::kFloat));
  for (size_t i = 0; i < layers.size(); ++i) {
    const models::BlockOutput out =
        models::run_block(layers[i], h, whole->recompute_of(static_cast<size_t>(layer_indices[i])));
    h = out.hidden;
    if (out.aux_loss.defined()) aux_loss = aux_loss + out.aux_loss;
  }
  if (!last) return h;
  // As the whole decoder's output: under tensor parallelism each rank projects onto its
  // vocabulary slice, and the hidden states' gradient is summed over the slices.
  return torch::nn::functional::linear(
      copy_to_tensor_parallel(whole->norm(h), whole->config.tensor_parallel),
      whole->tok_embeddings->weight);
}

DecoderPipeline::DecoderPipeline(models::Transformer& whole, const TrainOptions& o,
                                 const ParallelLayout& layout, const FullyShardOptions& options)
    : pp_(o.pp),
      rank_(layout.pipeline->rank()),
      balances_experts_(o.balances_experts()),
      layout_(layout) {
  const int64_t stages = o.pp * o.virtual_stages;
  std::vector<PipelineStage> pipeline_stages;
  for (int64_t v = 0; v < o.virtual_stages; ++v) {
    Sharded<DecoderStage> chunk(DecoderStage(whole, v * pp_ + rank_, stages));
    for (auto& layer : chunk->layers) shard_block(layer, options, layout);
    const FSDPModule fsdp = fully_shard(chunk, options);
    materialize(*chunk);
    chunks_.push_back(chunk);
    PipelineStage stage{.forward = [chunk](const at::Tensor& x) mutable { return chunk(x); },
                        .group = layout.pipeline,
                        .fsdp = fsdp,
                        .device = layout.mesh.world()->device()};
    // The MoE layers' balancing losses, as the whole decoder adds them to its loss.
    if (balances_experts_) stage.aux_loss = [chunk] { return chunk->aux_loss; };
    pipeline_stages.push_back(std::move(stage));
  }
  // The pair of ranks holding stage 0 and the last stage at this data-parallel position:
  // the mesh is row-major with pp outermost.
  const int64_t world_rank = layout.mesh.world()->rank();
  const int64_t stride = layout.mesh.world()->size() / pp_, position = world_rank % stride;
  if (rank_ == 0 || rank_ == pp_ - 1) {
    embedding_group_ = layout.mesh.world()->new_group("pp_embedding_" + std::to_string(position),
                                                      {position, (pp_ - 1) * stride + position});
  }
  saved_part_ = whole_named_part(chunks_, /*tied_copy=*/false);
  loaded_part_ = whole_named_part(chunks_, /*tied_copy=*/true);
  const GroupPtr tp = layout.tensor_parallel;
  auto loss_fn = [tp](const at::Tensor& logits, const at::Tensor& target) {
    return next_byte_cross_entropy(logits, target, tp);
  };
  if (o.pp_schedule == "gpipe") {
    schedule_ = std::make_unique<GPipeSchedule>(pipeline_stages[0], o.microbatches, loss_fn);
  } else if (o.pp_schedule == "1f1b") {
    schedule_ = std::make_unique<OneFOneBSchedule>(pipeline_stages[0], o.microbatches, loss_fn);
  } else {
    schedule_ = std::make_unique<InterleavedOneFOneBSchedule>(std::move(pipeline_stages),
                                                              o.microbatches, loss_fn);
  }
}

std::vector<at::Tensor> DecoderPipeline::parameters() {
  std::vector<at::Tensor> params;
  for (auto& chunk : chunks_) {
    for (const at::Tensor& p : chunk->parameters()) params.push_back(p);
  }
  return params;
}

at::Tensor DecoderPipeline::tied_weight() {
  for (auto& chunk : chunks_) {
    if (at::Tensor* weight = chunk->named_parameters().find("tok_embeddings.weight")) {
      return *weight;
    }
  }
  return {};
}

DecoderPipeline::Losses DecoderPipeline::forward_backward(const Batch& batch) {
  const c10::Device device = layout_.mesh.world()->device();
  const GroupPtr& cp = layout_.context_parallel;
  const PipelineStepResult result = schedule_->step(
      rank_ == 0 ? shard_sequence(batch.data.to(device), cp) : at::Tensor(),
      holds_last_stage() ? shard_sequence(batch.target.to(device), cp) : at::Tensor());
  if (embedding_group_) {
    hp::all_reduce(tied_weight().mutable_grad(), ReduceOp::kSum, *embedding_group_).wait();
  }
  at::Tensor loss =
      holds_last_stage() ? result.loss.to(at::kFloat).cpu() : at::zeros({}, at::kFloat);
  hp::broadcast(loss, pp_ - 1, *layout_.pipeline).wait();
  if (!balances_experts_) return {loss, at::Tensor()};
  at::Tensor balance_loss = result.aux_loss.to(at::kFloat).cpu();
  hp::all_reduce(balance_loss, ReduceOp::kSum, *layout_.pipeline).wait();
  return {loss, balance_loss};
}

double DecoderPipeline::clip_grad_norm(double max_norm) {
  // This stage's norm, the last stage's copy of the tied weight left out ...
  std::vector<at::Tensor> own;
  for (auto& chunk : chunks_) {
    for (const auto& item : chunk->named_parameters()) {
      if (!(chunk->last && item.key() == "tok_embeddings.weight")) {
        own.push_back(item.value());
      }
    }
  }
  const double stage_norm = clip_grad_norm_(own, std::numeric_limits<double>::infinity());
  // ... then over the stages.
  at::Tensor squares = at::full({1}, stage_norm * stage_norm, at::kDouble);
  hp::all_reduce(squares, ReduceOp::kSum, *layout_.pipeline).wait();
  const double norm = std::sqrt(squares.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    torch::NoGradGuard no_grad;
    for (at::Tensor& p : parameters()) {
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
    }
  }
  return norm;
}

at::Tensor DecoderPipeline::logits(const at::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  const c10::Device device = layout_.mesh.world()->device();
  const Group& group = *layout_.pipeline;
  const int64_t stages = pp_ * static_cast<int64_t>(chunks_.size());
  std::vector<std::pair<at::Tensor, CommHandle>> sends;
  at::Tensor output;
  for (size_t v = 0; v < chunks_.size(); ++v) {
    const int64_t stage = static_cast<int64_t>(v) * pp_ + rank_;
    at::Tensor input;
    if (stage == 0) {
      input = tokens.to(device);
    } else {
      const int64_t previous = (rank_ + pp_ - 1) % pp_;
      at::Tensor record = at::empty({kMaxDims + 2}, at::kLong);
      hp::recv(record, previous, group, boundary_tag(stage - 1, 0)).wait();
      std::vector<int64_t> sizes(record[0].item<int64_t>());
      for (size_t d = 0; d < sizes.size(); ++d) sizes[d] = record[d + 1].item<int64_t>();
      const auto dtype = static_cast<c10::ScalarType>(record[kMaxDims + 1].item<int64_t>());
      input = at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
      hp::recv(input, previous, group, boundary_tag(stage - 1, 1)).wait();
    }
    output = chunks_[v](input);
    if (stage == stages - 1) break;
    const at::Tensor activation = output.contiguous();
    at::Tensor record = at::zeros({kMaxDims + 2}, at::kLong);
    record[0] = activation.dim();
    for (int64_t d = 0; d < activation.dim(); ++d) record[d + 1] = activation.size(d);
    record[kMaxDims + 1] = static_cast<int64_t>(activation.scalar_type());
    const int64_t next = (rank_ + 1) % pp_;
    sends.emplace_back(record, hp::send(record, next, group, boundary_tag(stage, 0)));
    sends.emplace_back(activation, hp::send(activation, next, group, boundary_tag(stage, 1)));
    output = at::Tensor();
  }
  for (auto& send : sends) send.second.wait();
  return output;
}

bool DecoderPipeline::tied_copies_equal() {
  at::Tensor differ = at::zeros({1}, at::kInt);
  if (embedding_group_) {
    const at::Tensor weight = tied_weight().detach();
    at::Tensor low = weight.clone(), high = weight.clone();
    hp::all_reduce(low, ReduceOp::kMin, *embedding_group_).wait();
    hp::all_reduce(high, ReduceOp::kMax, *embedding_group_).wait();
    differ[0] = low.equal(high) ? 0 : 1;
  }
  hp::all_reduce(differ, ReduceOp::kMax, *layout_.mesh.world()->world_group()).wait();
  return differ.item<int>() == 0;
}

}  // namespace hp::trainer

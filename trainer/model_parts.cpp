#include "trainer/model_parts.h"

#include <torch/torch.h>

#include <cstdio>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>

#include "hyperparallel/clip_grad.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/tensor_parallel.h"
#include "models/transformer.h"
#include "trainer/pipeline_stages.h"
#include "trainer/text_data.h"
#include "trainer/usage_error.h"

namespace hp::trainer {
namespace {

using Decoder = Sharded<models::Transformer>;

// The mean next-byte loss of this rank's part of `batch`: its part of each sequence (cp)
// and its slice of the vocabulary (tp). Returns the loss and the bytes it averages.
template <typename Model>
std::pair<at::Tensor, int64_t> next_byte_loss(Model& model, const Batch& batch,
                                              const ParallelLayout& layout) {
  const c10::Device device = layout.mesh.world()->device();  // fully_shard's, too
  const at::Tensor data = hp::shard_sequence(batch.data.to(device), layout.context_parallel);
  const at::Tensor target = hp::shard_sequence(batch.target.to(device), layout.context_parallel);
  const at::Tensor loss = next_byte_cross_entropy(model(data), target, layout.tensor_parallel);
  return {loss, target.numel()};
}

// The whole logits [T, vocab] of one sequence `tokens` [1, T] by `forward` (this rank's
// logits of this rank's tokens): padded at its end to a length cp can split (causal:
// padding changes no earlier logit), its parts gathered back from the cp ranks, its
// vocabulary slices from the tp ranks. Undefined where `forward` gives none (a pipeline
// rank without the last stage, as are its cp and tp peers).
template <typename Forward>
at::Tensor whole_logits(Forward&& forward, const at::Tensor& tokens, const ParallelLayout& layout) {
  const int64_t length = tokens.size(1), cp = layout.context_parallel->size();
  const int64_t padded = (length + 2 * cp - 1) / (2 * cp) * (2 * cp);
  const at::Tensor on_device = tokens.to(layout.mesh.world()->device());
  at::Tensor input = cp > 1 ? torch::constant_pad_nd(on_device, {0, padded - length}) : on_device;
  at::Tensor logits = forward(hp::shard_sequence(input, layout.context_parallel));
  if (!logits.defined()) return logits;
  logits = hp::unshard_sequence(logits, layout.context_parallel);
  return hp::gather_from_tensor_parallel(logits, layout.tensor_parallel)[0].narrow(0, 0, length);
}

hp::models::TransformerConfig decoder_config(const TrainOptions& o, const ParallelLayout& layout) {
  hp::models::TransformerConfig config;
  config.vocab = kByteVocab;
  config.dim = o.dim;
  config.heads = o.heads;
  config.layers = o.layers;
  config.ffn_hidden = 4 * o.dim;
  config.max_seq = o.seq;
  config.tensor_parallel = layout.tensor_parallel;
  config.context_parallel = layout.context_parallel;
  if (o.experts > 0) {
    for (int64_t i = 1; i < o.layers; i += 2) config.moe.layers.push_back(i);
    config.moe.num_experts = o.experts;
    config.moe.top_k = o.top_k;
    config.moe.expert_hidden = 2 * o.dim;
    config.moe.load_balance_coef = o.balance_loss;
    config.expert_parallel = layout.expert_parallel;
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  return config;
}

// Recorded, not allocated: no rank ever holds the whole model; each materializes (or
// loads) only its shards once it is sharded.
Decoder deferred_decoder(const TrainOptions& o, const ParallelLayout& layout) {
  const hp::models::TransformerConfig config = decoder_config(o, layout);
  torch::manual_seed(static_cast<uint64_t>(o.seed));  // the same initial model on every rank
  Decoder model = hp::deferred_init([&] { return Decoder(config); });
  model->recompute_layers.assign(o.layers, o.recompute_options());
  return model;
}

ModelSize size_of(Decoder& model) {
  ModelSize size;
  size.params = numel_of(model->parameters(), /*whole=*/true);
  size.active_params = static_cast<double>(size.params);
  for (auto& layer : model->layers) {
    if (!layer->moe) continue;
    const auto& moe = layer->moe->options;
    size.active_params -=
        static_cast<double>(numel_of(layer->moe->experts->parameters(), true)) *
        (1.0 - static_cast<double>(moe.top_k) / static_cast<double>(moe.num_experts));
  }
  return size;
}

hp::FullyShardOptions shard_options(const TrainOptions& o, const ParallelLayout& layout) {
  hp::FullyShardOptions options;
  options.mesh = layout.dense_mesh;
  if (o.mp == "bf16") {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  options.comm_fusion = o.comm_fusion;
  options.comm_fusion_bucket_bytes = o.comm_fusion_bucket_bytes;
  options.comm_policy.all_gather_codec = hp::parse_comm_codec(o.ag_codec);
  options.comm_policy.reduce_scatter_codec = hp::parse_comm_codec(o.rs_codec);
  options.comm_policy.block_size = o.codec_block;
  options.comm_policy.error_feedback = o.error_feedback;
  return options;
}

// --clip-grad's limit; an infinite one only measures the norm.
double max_grad_norm(const TrainOptions& o) {
  return o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity();
}

// The whole decoder on every rank: each block, each MoE layer's experts (before their
// block, over the ranks orthogonal to ep) and the root fully_shard-ed.
class WholeDecoder final : public ModelParts {
 public:
  WholeDecoder(Decoder model, const TrainOptions& o, const ParallelLayout& layout)
      : ModelParts(size_of(model)), model_(std::move(model)), o_(o), layout_(layout) {
    const FullyShardOptions options = shard_options(o, layout);
    for (auto& layer : model_->layers) shard_block(layer, options, layout);
    fully_shard(model_, options);
  }

  std::vector<at::Tensor> parameters() override { return model_->parameters(); }
  torch::nn::Module& saved() override { return *model_; }
  torch::nn::Module& loaded() override { return *model_; }
  bool whole() const override { return true; }
  void materialize() override { hp::materialize(*model_); }

  StepResult forward_backward(const Batch& batch) override {
    StepResult result;
    result.loss = next_byte_loss(model_, batch, layout_).first;
    if (o_.balances_experts()) result.balance_loss = model_->aux_loss().detach();
    (o_.balances_experts() ? result.loss + model_->aux_loss() : result.loss).backward();
    // Shards combined across ranks.
    result.grad_norm = clip_grad_norm_(model_->parameters(), max_grad_norm(o_));
    return result;
  }

  Evaluation evaluation() override {
    return {
        .loss_of = [this](const Batch& batch) { return next_byte_loss(model_, batch, layout_); },
        .next_logits =
            [this](const at::Tensor& tokens) { return whole_logits(model_, tokens, layout_)[-1]; }};
  }

  void check_copies_equal(int64_t /*rank*/) override {}  // one copy of every weight

 private:
  Decoder model_;
  const TrainOptions& o_;
  ParallelLayout layout_;
};

// This rank's pipeline stages (--pp), materialized as they are made.
class PipelinedDecoder final : public ModelParts {
 public:
  PipelinedDecoder(Decoder model, const TrainOptions& o, const ParallelLayout& layout)
      : ModelParts(size_of(model)),
        pipeline_(model, o, layout, shard_options(o, layout)),
        o_(o),
        layout_(layout) {}

  std::vector<at::Tensor> parameters() override { return pipeline_.parameters(); }
  torch::nn::Module& saved() override { return pipeline_.saved_part(); }
  torch::nn::Module& loaded() override { return pipeline_.loaded_part(); }
  bool whole() const override { return false; }
  void materialize() override {}  // the stages were, when cut from the decoder

  StepResult forward_backward(const Batch& batch) override {
    const DecoderPipeline::Losses losses = pipeline_.forward_backward(batch);
    return {.loss = losses.loss,
            .balance_loss = losses.balance_loss,
            .grad_norm = pipeline_.clip_grad_norm(max_grad_norm(o_))};
  }

  // Forward only through the stages; the last stage's results sent to the others.
  Evaluation evaluation() override {
    return {.loss_of = [this](const Batch& batch) { return loss_of(batch); },
            .next_logits = [this](const at::Tensor& tokens) { return next_logits(tokens); }};
  }

  // The two copies of the tied embedding (stage 0's and the last stage's) are the same,
  // bit for bit, on every data-parallel position.
  void check_copies_equal(int64_t rank) override {
    if (!pipeline_.tied_copies_equal()) {
      throw std::runtime_error(
          "the tied embedding's copies on the first and last pipeline stages differ");
    }
    if (rank == 0) {
      std::printf("tied embedding: the first and last stages' copies are bitwise equal\n");
    }
  }

 private:
  std::pair<at::Tensor, int64_t> loss_of(const Batch& batch) {
    const at::Tensor logits =
        pipeline_.logits(shard_sequence(batch.data, layout_.context_parallel));
    if (!logits.defined()) return {at::Tensor(), 0};
    const at::Tensor target =
        shard_sequence(batch.target.to(logits.device()), layout_.context_parallel);
    return {next_byte_cross_entropy(logits, target, layout_.tensor_parallel), target.numel()};
  }

  at::Tensor next_logits(const at::Tensor& tokens) {
    const at::Tensor logits =
        whole_logits([this](const at::Tensor& x) { return pipeline_.logits(x); }, tokens, layout_);
    at::Tensor next = logits.defined() ? logits[-1].to(at::kCPU, at::kFloat).contiguous()
                                       : torch::empty({kByteVocab}, torch::kFloat);
    broadcast(next, layout_.pipeline->size() - 1, *layout_.pipeline).wait();
    return next;
  }

  DecoderPipeline pipeline_;
  const TrainOptions& o_;
  ParallelLayout layout_;
};

}  // namespace

std::unique_ptr<ModelParts> make_model_parts(const TrainOptions& o, const ParallelLayout& layout) {
  Decoder model = deferred_decoder(o, layout);
  if (o.pp > 1) return std::make_unique<PipelinedDecoder>(std::move(model), o, layout);
  return std::make_unique<WholeDecoder>(std::move(model), o, layout);
}

int64_t numel_of(const std::vector<at::Tensor>& params, bool whole) {
  int64_t n = 0;
  for (const auto& p : params) {
    const auto slice = whole ? hp::parallel_slice_of(p) : std::nullopt;
    n += p.numel() * (slice ? slice->group->size() : 1);
  }
  return n;
}

}  // namespace hp::trainer

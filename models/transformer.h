#pragma once
// A small decoder-only transformer (Llama-style blocks) for tests, examples and
// benchmarks: token + learned position embeddings, pre-norm decoder blocks (RMSNorm ->
// causal multi-head attention -> residual, RMSNorm -> SwiGLU MLP -> residual), a final
// RMSNorm and an output projection tied to the token embedding.
//
// The blocks are declared Sharded<...>: without fully_shard they are plain modules, so
// the same class is also the single-process reference. They are also registered in a
// ModuleList "layers", so parameters are named "layers.0.attn.wq.weight" and so on.
//
// With a tensor-parallel group (config.tensor_parallel), attention heads, SwiGLU hidden
// units and the vocabulary are split over it (Megatron-LM's layout: column-parallel
// wq/wk/wv/w1/w3, row-parallel wo/w2, vocab-parallel embedding and tied output
// projection); the forward then returns this rank's vocabulary slice of the logits, for
// hp::vocab_parallel_cross_entropy. Without one, the layers are plain LibTorch ones.
// With a context-parallel group (config.context_parallel), the tokens given to it are
// this rank's part of each sequence (hp::shard_sequence). Layers listed in
// config.moe.layers have a mixture-of-experts FFN ("layers.<i>.moe.router.weight",
// "layers.<i>.moe.experts.w1", ...), its experts split over config.expert_parallel.

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/activation_swap.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/expert_parallel.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/recompute.h"
#include "hyperparallel/tensor_parallel.h"

namespace hp::models {

// Which layers have a mixture-of-experts FFN (hp::MoE) instead of the dense SwiGLU.
struct MoELayers {
  std::vector<int64_t> layers;  // empty: every FFN is dense
  int64_t num_experts = 4;
  int64_t top_k = 2;
  int64_t expert_hidden = 128;  // SwiGLU hidden size of each expert
  std::optional<double> capacity_factor;
  double load_balance_coef = 0;  // > 0: Transformer::aux_loss() is the balancing loss
};

struct TransformerConfig {
  int64_t vocab = 64;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t ffn_hidden = 256;  // SwiGLU hidden size
  int64_t max_seq = 64;      // rows of the position embedding: the longest input
  // Splits heads, ffn_hidden and vocab over its ranks; null: no tensor parallelism.
  GroupPtr tensor_parallel;
  // Context parallelism: the sequence is split over this group (null or size 1: off).
  // The tokens given to the model are then this rank's part (hp::shard_sequence with
  // these options); max_seq bounds the whole sequence.
  hp::GroupPtr context_parallel;
  hp::ContextParallelOptions context_parallel_options;
  MoELayers moe;
  // The MoE layers' experts are split over it; null: all experts on every rank.
  GroupPtr expert_parallel;

  bool is_moe_layer(int64_t layer) const {
    return std::find(moe.layers.begin(), moe.layers.end(), layer) != moe.layers.end();
  }
  MoEOptions moe_options() const {
    return {.dim = dim,
            .expert_hidden = moe.expert_hidden,
            .num_experts = moe.num_experts,
            .top_k = moe.top_k,
            .capacity_factor = moe.capacity_factor,
            .load_balance_coef = moe.load_balance_coef};
  }

  void validate() const {
    auto require = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument("TransformerConfig: " + what);
    };
    require(vocab > 0 && dim > 0 && heads > 0 && layers >= 0 && ffn_hidden > 0 && max_seq > 0,
            "sizes must be positive (layers may be 0)");
    require(dim % heads == 0, "dim (" + std::to_string(dim) + ") must be divisible by heads (" +
                                  std::to_string(heads) + ")");
    const int64_t tp = tensor_parallel ? tensor_parallel->size() : 1;
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"heads", heads},
                                      {"ffn_hidden", ffn_hidden},
                                      {"vocab", vocab}}) {
      require(value % tp == 0, std::string(name) + " (" + std::to_string(value) +
                                   ") must be divisible by the tensor-parallel size (" +
                                   std::to_string(tp) + ")");
    }
    for (int64_t layer : moe.layers) {
      require(layer >= 0 && layer < layers, "moe.layers names layer " + std::to_string(layer) +
                                                " but the model has " + std::to_string(layers) +
                                                " layers");
    }
    if (!moe.layers.empty()) moe_options().validate();
  }
};

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6)
      : eps(eps), weight(register_parameter("weight", torch::ones({dim}))) {}
  at::Tensor forward(const at::Tensor& x) {
    // Normalized in fp32 so that bf16 activations keep their scale.
    at::Tensor x32 = x.to(at::kFloat);
    at::Tensor normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return normed.to(x.scalar_type()) * weight;
  }
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// Without bias, split over `group` (null: a plain linear layer).
inline hp::ColumnParallelLinear column_linear(int64_t in, int64_t out, const GroupPtr& group) {
  return hp::ColumnParallelLinear(
      hp::ColumnParallelLinearOptions{.in_features = in, .out_features = out, .bias = false},
      group);
}
inline hp::RowParallelLinear row_linear(int64_t in, int64_t out, const GroupPtr& group) {
  return hp::RowParallelLinear(
      hp::RowParallelLinearOptions{.in_features = in, .out_features = out, .bias = false}, group);
}

struct AttentionImpl : torch::nn::Module {
  // `tensor_parallel`: heads split over it (heads / its size on this rank).
  // `context_parallel`: x is this rank's part of the sequence.
  AttentionImpl(int64_t dim, int64_t heads, const GroupPtr& tensor_parallel = nullptr,
                GroupPtr context_parallel = nullptr,
                hp::ContextParallelOptions context_parallel_options = {})
      : heads(heads / (tensor_parallel ? tensor_parallel->size() : 1)),
        head_dim(dim / heads),
        wq(register_module("wq", column_linear(dim, dim, tensor_parallel))),
        wk(register_module("wk", column_linear(dim, dim, tensor_parallel))),
        wv(register_module("wv", column_linear(dim, dim, tensor_parallel))),
        wo(register_module("wo", row_linear(dim, dim, tensor_parallel))),
        context_parallel(std::move(context_parallel)),
        context_parallel_options(context_parallel_options) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t batch = x.size(0), seq = x.size(1);
    auto split_heads = [&](const at::Tensor& t) {
      return t.view({batch, seq, heads, head_dim}).transpose(1, 2);  // [B, H, T, hd]
    };
    at::Tensor q = split_heads(wq(x)), k = split_heads(wk(x)), v = split_heads(wv(x));
    at::Tensor attended;
    if (context_parallel && context_parallel->size() > 1) {
      attended =
          hp::context_parallel_attention(q, k, v, context_parallel, context_parallel_options);
    } else {
      at::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(head_dim));
      at::Tensor future = torch::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
      scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
      // Softmax in fp32: bf16 scores lose the small probabilities.
      at::Tensor probs = torch::softmax(scores, -1, at::kFloat).to(v.scalar_type());
      attended = torch::matmul(probs, v);
    }
    at::Tensor out = attended.transpose(1, 2).reshape({batch, seq, -1});
    return wo(out);
  }

  int64_t heads, head_dim;  // heads: this rank's
  hp::ColumnParallelLinear wq, wk, wv;
  hp::RowParallelLinear wo;
  hp::GroupPtr context_parallel;  // x is this rank's part of the sequence when size > 1
  hp::ContextParallelOptions context_parallel_options;
};
TORCH_MODULE(Attention);

struct SwiGluImpl : torch::nn::Module {
  // `group`: hidden units split over it.
  SwiGluImpl(int64_t dim, int64_t hidden, const GroupPtr& group = nullptr)
      : w1(register_module("w1", column_linear(dim, hidden, group))),
        w3(register_module("w3", column_linear(dim, hidden, group))),
        w2(register_module("w2", row_linear(hidden, dim, group))) {}
  at::Tensor forward(const at::Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }
  hp::ColumnParallelLinear w1, w3;  // gate, up
  hp::RowParallelLinear w2;         // down
};
TORCH_MODULE(SwiGlu);

// Pre-norm block: attention, then the dense SwiGLU ("mlp") or, in an MoE layer, the
// mixture of experts ("moe").
struct DecoderBlockImpl : torch::nn::Module {
  DecoderBlockImpl(const TransformerConfig& config, bool moe_ffn = false)
      : attn_norm(register_module("attn_norm", RMSNorm(config.dim))),
        attn(register_module("attn",
                             Attention(config.dim, config.heads, config.tensor_parallel,
                                       config.context_parallel, config.context_parallel_options))),
        mlp_norm(register_module("mlp_norm", RMSNorm(config.dim))) {
    if (moe_ffn) {
      moe = register_module("moe", MoE(config.moe_options(), config.expert_parallel));
    } else {
      mlp = register_module("mlp", SwiGlu(config.dim, config.ffn_hidden, config.tensor_parallel));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attn(attn_norm(x));
    at::Tensor normed = mlp_norm(h);
    return h + (moe ? moe(normed) : mlp(normed));
  }
  RMSNorm attn_norm;
  Attention attn;
  RMSNorm mlp_norm;
  SwiGlu mlp{nullptr};  // dense layers
  MoE moe{nullptr};     // MoE layers
};
TORCH_MODULE(DecoderBlock);

// What a block's forward gives: the hidden states and, for an MoE block with a balancing
// loss, that loss with its graph (undefined otherwise).
struct BlockOutput {
  at::Tensor hidden;
  at::Tensor aux_loss;
};

// Runs `block` on x, as a recomputed region when `recompute` is set. An MoE block's
// balancing loss leaves the region as a second output: a reentrant region runs without
// autograd, so the loss the MoE layer keeps has no graph, and only the region's outputs
// lead backward into it.
inline BlockOutput run_block(hp::Sharded<DecoderBlock> block, const at::Tensor& x,
                             const std::optional<hp::RecomputeOptions>& recompute) {
  const bool balanced = block->moe && block->moe->options.load_balance_coef > 0;
  auto run = [block, balanced](const std::vector<at::Tensor>& in) mutable {
    std::vector<at::Tensor> out{block(in[0])};
    if (balanced) out.push_back(block->moe->aux_loss());
    return out;
  };
  const std::vector<at::Tensor> outputs =
      recompute ? hp::recompute(run, {x}, *recompute) : run({x});
  return {outputs[0], balanced ? outputs[1] : at::Tensor()};
}

// GPT-2 style: N(0, 0.02), residual output projections scaled down by depth, so that
// the initial logits are small (loss starts near log(vocab)). Draws from the global
// generator in parameter order, so torch::manual_seed fixes the result (parallel slices
// included: tensor-parallel weights and experts are cut from the whole tensor drawn in
// their place).
inline void init_decoder_weights(torch::nn::Module& decoder, int64_t layers) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * std::max<int64_t>(layers, 1));
  for (auto& item : decoder.named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& param = item.value();
    if (param.dim() < 2) continue;  // norm weights stay 1
    const bool residual_out = name.ends_with("attn.wo.weight") || name.ends_with("mlp.w2.weight") ||
                              name.ends_with("experts.w2");
    const double stddev = residual_out ? residual_std : 0.02;
    // A parallel slice: drawn whole, as the single-process model draws it.
    if (auto slice = hp::parallel_slice_of(param)) {
      std::vector<int64_t> whole_shape = param.sizes().vec();
      whole_shape[slice->dim] *= slice->group->size();
      param.copy_(hp::slice_of(param.new_empty(whole_shape).normal_(0.0, stddev), *slice));
    } else {
      param.normal_(0.0, stddev);
    }
  }
}

// config.layers decoder blocks, registered on `owner` as the ModuleList "layers" (names
// "layers.<i>....").
inline std::vector<hp::Sharded<DecoderBlock>> register_decoder_layers(
    torch::nn::Module& owner, const TransformerConfig& config) {
  auto list = owner.register_module("layers", torch::nn::ModuleList());
  std::vector<hp::Sharded<DecoderBlock>> layers;
  for (int64_t i = 0; i < config.layers; ++i) {
    layers.emplace_back(DecoderBlock(config, config.is_moe_layer(i)));
    list->push_back(layers.back().ptr());
  }
  return layers;
}

struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const TransformerConfig& config) : config(checked(config)) {
    tok_embeddings = register_module(
        "tok_embeddings",
        hp::VocabParallelEmbedding(config.vocab, config.dim, config.tensor_parallel));
    pos_embeddings =
        register_module("pos_embeddings", torch::nn::Embedding(config.max_seq, config.dim));
    layers = register_decoder_layers(*this, config);
    norm = register_module("norm", RMSNorm(config.dim));
    init_weights();
  }

  // tokens: [B, T] int64, T <= max_seq. Returns logits [B, T, vocab] (tensor-parallel:
  // this rank's slice [B, T, vocab / tp]).
  at::Tensor forward(const at::Tensor& tokens) {
    // Tied output projection: the embedding matrix is the only copy of these weights.
    return torch::nn::functional::linear(
        hp::copy_to_tensor_parallel(hidden(tokens), config.tensor_parallel),
        tok_embeddings->weight);
  }

  // The final hidden states norm(h) [B, T, dim] that the output projection maps to
  // logits, for losses that project them themselves (e.g. chunked cross-entropy).
  at::Tensor hidden(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);
    aux_loss_ = torch::zeros({}, h.options().dtype(at::kFloat));
    for (size_t i = 0; i < layers.size(); ++i) {
      std::optional<hp::SwapActivations> swapped;
      if (i < swap_layers.size() && swap_layers[i]) swapped.emplace(activation_swap);
      const BlockOutput out = run_block(layers[i], h, recompute_of(i));
      h = out.hidden;
      if (out.aux_loss.defined()) aux_loss_ = aux_loss_ + out.aux_loss;
    }
    return norm(h);
  }

  // Layer i's entry of recompute_layers (none when it has no entry).
  std::optional<hp::RecomputeOptions> recompute_of(size_t layer) const {
    return layer < recompute_layers.size() ? recompute_layers[layer] : std::nullopt;
  }

  // The token and position embeddings of `tokens` [B, T] (under context parallelism this
  // rank's part of the sequence, at its positions in the whole one): [B, T, dim].
  at::Tensor embed(const at::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2, "Transformer expects tokens [batch, seq], got ", tokens.sizes());
    const auto& cp = config.context_parallel;
    const int64_t seq = cp ? tokens.size(1) * cp->size() : tokens.size(1);
    TORCH_CHECK(seq <= config.max_seq, "sequence length ", seq, " exceeds max_seq ",
                config.max_seq);
    at::Tensor positions =
        cp ? hp::sequence_positions(seq, cp, config.context_parallel_options, tokens.options())
           : torch::arange(seq, tokens.options());
    return tok_embeddings(tokens) + pos_embeddings(positions);
  }

  // The MoE layers' load-balancing losses of the last forward, summed (a zero without
  // graph when there are none; undefined before the first forward): add it to the loss.
  const at::Tensor& aux_loss() const { return aux_loss_; }

  TransformerConfig config;
  hp::VocabParallelEmbedding tok_embeddings{nullptr};
  torch::nn::Embedding pos_embeddings{nullptr};
  std::vector<hp::Sharded<DecoderBlock>> layers;
  RMSNorm norm{nullptr};
  // Activation recomputation of layer i when recompute_layers[i] is set (missing
  // entries: none).
  std::vector<std::optional<hp::RecomputeOptions>> recompute_layers;
  // Activation swap of layer i when swap_layers[i] is set (missing entries: none): what
  // the layer saves for backward (a recomputed layer: its input) goes to activation_swap
  // and comes back ahead of the layer's backward.
  std::vector<bool> swap_layers;
  hp::ActivationSwap activation_swap;

 private:
  static const TransformerConfig& checked(const TransformerConfig& config) {
    config.validate();
    return config;
  }

  void init_weights() { init_decoder_weights(*this, config.layers); }

  at::Tensor aux_loss_;
};
TORCH_MODULE(Transformer);

}  // namespace hp::models

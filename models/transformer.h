#pragma once
// A small decoder-only transformer (Llama-style blocks) for tests, examples and
// benchmarks: token + learned position embeddings, pre-norm decoder blocks (RMSNorm ->
// causal multi-head attention -> residual, RMSNorm -> SwiGLU MLP -> residual), a final
// RMSNorm and an output projection tied to the token embedding.
//
// The blocks are declared Sharded<...>: without fully_shard they are plain modules, so
// the same class is also the single-process reference. They are also registered in a
// ModuleList "layers", so parameters are named "layers.0.attn.wq.weight" and so on.

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/context_parallel.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/recompute.h"

namespace hp::models {

struct TransformerConfig {
  int64_t vocab = 64;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t ffn_hidden = 256;  // SwiGLU hidden size
  int64_t max_seq = 64;      // rows of the position embedding: the longest input
  // Context parallelism: the sequence is split over this group (null or size 1: off).
  // The tokens given to the model are then this rank's part (hp::shard_sequence with
  // these options); max_seq bounds the whole sequence.
  hp::GroupPtr context_parallel;
  hp::ContextParallelOptions context_parallel_options;

  void validate() const {
    auto require = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument("TransformerConfig: " + what);
    };
    require(vocab > 0 && dim > 0 && heads > 0 && layers >= 0 && ffn_hidden > 0 && max_seq > 0,
            "sizes must be positive (layers may be 0)");
    require(dim % heads == 0, "dim (" + std::to_string(dim) + ") must be divisible by heads (" +
                                  std::to_string(heads) + ")");
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

inline torch::nn::Linear linear_no_bias(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t dim, int64_t heads, hp::GroupPtr context_parallel = nullptr,
                hp::ContextParallelOptions context_parallel_options = {})
      : heads(heads),
        head_dim(dim / heads),
        wq(register_module("wq", linear_no_bias(dim, dim))),
        wk(register_module("wk", linear_no_bias(dim, dim))),
        wv(register_module("wv", linear_no_bias(dim, dim))),
        wo(register_module("wo", linear_no_bias(dim, dim))),
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

  int64_t heads, head_dim;
  torch::nn::Linear wq, wk, wv, wo;
  hp::GroupPtr context_parallel;  // x is this rank's part of the sequence when size > 1
  hp::ContextParallelOptions context_parallel_options;
};
TORCH_MODULE(Attention);

struct SwiGluImpl : torch::nn::Module {
  SwiGluImpl(int64_t dim, int64_t hidden)
      : w1(register_module("w1", linear_no_bias(dim, hidden))),
        w3(register_module("w3", linear_no_bias(dim, hidden))),
        w2(register_module("w2", linear_no_bias(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }
  torch::nn::Linear w1, w3, w2;  // gate, up, down
};
TORCH_MODULE(SwiGlu);

struct DecoderBlockImpl : torch::nn::Module {
  explicit DecoderBlockImpl(const TransformerConfig& config)
      : attn_norm(register_module("attn_norm", RMSNorm(config.dim))),
        attn(register_module("attn", Attention(config.dim, config.heads, config.context_parallel,
                                               config.context_parallel_options))),
        mlp_norm(register_module("mlp_norm", RMSNorm(config.dim))),
        mlp(register_module("mlp", SwiGlu(config.dim, config.ffn_hidden))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attn(attn_norm(x));
    return h + mlp(mlp_norm(h));
  }
  RMSNorm attn_norm;
  Attention attn;
  RMSNorm mlp_norm;
  SwiGlu mlp;
};
TORCH_MODULE(DecoderBlock);

// GPT-2 style: N(0, 0.02), residual output projections scaled down by depth, so that
// the initial logits are small (loss starts near log(vocab)). Draws from the global
// generator in parameter order, so torch::manual_seed fixes the result.
inline void init_decoder_weights(torch::nn::Module& decoder, int64_t layers) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * std::max<int64_t>(layers, 1));
  for (auto& item : decoder.named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& param = item.value();
    if (param.dim() < 2) continue;  // norm weights stay 1
    const bool residual_out = name.ends_with("attn.wo.weight") || name.ends_with("mlp.w2.weight");
    param.normal_(0.0, residual_out ? residual_std : 0.02);
  }
}

// config.layers decoder blocks, registered on `owner` as the ModuleList "layers" (names
// "layers.<i>....").
inline std::vector<hp::Sharded<DecoderBlock>> register_decoder_layers(
    torch::nn::Module& owner, const TransformerConfig& config) {
  auto list = owner.register_module("layers", torch::nn::ModuleList());
  std::vector<hp::Sharded<DecoderBlock>> layers;
  for (int64_t i = 0; i < config.layers; ++i) {
    layers.emplace_back(DecoderBlock(config));
    list->push_back(layers.back().ptr());
  }
  return layers;
}

struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const TransformerConfig& config) : config(checked(config)) {
    tok_embeddings =
        register_module("tok_embeddings", torch::nn::Embedding(config.vocab, config.dim));
    pos_embeddings =
        register_module("pos_embeddings", torch::nn::Embedding(config.max_seq, config.dim));
    layers = register_decoder_layers(*this, config);
    norm = register_module("norm", RMSNorm(config.dim));
    init_weights();
  }

  // tokens: [B, T] int64, T <= max_seq. Returns logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& tokens) {
    // Tied output projection: the embedding matrix is the only copy of these weights.
    return torch::nn::functional::linear(hidden(tokens), tok_embeddings->weight);
  }

  // The final hidden states norm(h) [B, T, dim] that the output projection maps to
  // logits, for losses that project them themselves (e.g. chunked cross-entropy).
  at::Tensor hidden(const at::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2, "Transformer expects tokens [batch, seq], got ", tokens.sizes());
    // Under context parallelism the tokens are this rank's part of the sequence.
    const auto& cp = config.context_parallel;
    const int64_t seq = cp ? tokens.size(1) * cp->size() : tokens.size(1);
    TORCH_CHECK(seq <= config.max_seq, "sequence length ", seq, " exceeds max_seq ",
                config.max_seq);
    at::Tensor positions =
        cp ? hp::sequence_positions(seq, cp, config.context_parallel_options, tokens.options())
           : torch::arange(seq, tokens.options());
    at::Tensor h = tok_embeddings(tokens) + pos_embeddings(positions);
    for (size_t i = 0; i < layers.size(); ++i) {
      if (i < recompute_layers.size() && recompute_layers[i]) {
        h = hp::recompute([layer = layers[i]](const at::Tensor& x) mutable { return layer(x); }, h,
                          {.impl = *recompute_layers[i]});
      } else {
        h = layers[i](h);
      }
    }
    return norm(h);
  }

  TransformerConfig config;
  torch::nn::Embedding tok_embeddings{nullptr}, pos_embeddings{nullptr};
  std::vector<hp::Sharded<DecoderBlock>> layers;
  RMSNorm norm{nullptr};
  // Activation recomputation of layer i when recompute_layers[i] is set (missing
  // entries: none).
  std::vector<std::optional<hp::RecomputeImpl>> recompute_layers;

 private:
  static const TransformerConfig& checked(const TransformerConfig& config) {
    config.validate();
    return config;
  }

  void init_weights() { init_decoder_weights(*this, config.layers); }
};
TORCH_MODULE(Transformer);

}  // namespace hp::models

#pragma once
// A decoder-only transformer whose chosen layers have a mixture-of-experts FFN
// (hp::MoE, include/hyperparallel/expert_parallel.h) instead of the dense SwiGLU: the
// pieces of models/transformer.h (embeddings, RMSNorm, attention, SwiGLU, tied output)
// with blocks of either kind. Parameters are named "layers.<i>.mlp.w1.weight" in dense
// layers and "layers.<i>.moe.router.weight", "layers.<i>.moe.experts.w1" in MoE layers.
//
// Built with an expert-parallel group, each rank holds its slice of every MoE layer's
// experts; without one (the single-process reference) all experts. The same seed gives
// both the same parameters (the expert slices included): see init_moe_decoder_weights.

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/expert_parallel.h"
#include "hyperparallel/fully_shard.h"
#include "models/transformer.h"

namespace hp::models {

struct MoETransformerConfig {
  // vocab, dim, heads, layers, max_seq; ffn_hidden is the dense layers' SwiGLU width.
  TransformerConfig transformer;
  std::vector<int64_t> moe_layers;  // indices of the layers whose FFN is an MoE
  int64_t num_experts = 4;
  int64_t top_k = 2;
  int64_t expert_hidden = 128;
  std::optional<double> capacity_factor;
  double load_balance_coef = 0;

  bool is_moe_layer(int64_t layer) const {
    return std::find(moe_layers.begin(), moe_layers.end(), layer) != moe_layers.end();
  }

  MoEOptions moe_options() const {
    return {.dim = transformer.dim,
            .expert_hidden = expert_hidden,
            .num_experts = num_experts,
            .top_k = top_k,
            .capacity_factor = capacity_factor,
            .load_balance_coef = load_balance_coef};
  }

  void validate() const {
    transformer.validate();
    for (int64_t layer : moe_layers) {
      if (layer < 0 || layer >= transformer.layers) {
        throw std::invalid_argument("MoETransformerConfig: moe_layers names layer " +
                                    std::to_string(layer) + " but the model has " +
                                    std::to_string(transformer.layers) + " layers");
      }
    }
    moe_options().validate();
  }
};

// Pre-norm block: attention, then the dense SwiGLU ("mlp") or the MoE ("moe").
struct MoEDecoderBlockImpl : torch::nn::Module {
  MoEDecoderBlockImpl(const MoETransformerConfig& config, bool moe_ffn, GroupPtr ep_group)
      : attn_norm(register_module("attn_norm", RMSNorm(config.transformer.dim))),
        attn(register_module("attn", Attention(config.transformer.dim, config.transformer.heads))),
        mlp_norm(register_module("mlp_norm", RMSNorm(config.transformer.dim))) {
    if (moe_ffn) {
      moe = register_module("moe", MoE(config.moe_options(), std::move(ep_group)));
    } else {
      mlp = register_module("mlp", SwiGlu(config.transformer.dim, config.transformer.ffn_hidden));
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
TORCH_MODULE(MoEDecoderBlock);

// init_decoder_weights' scheme (N(0, 0.02), residual outputs scaled by depth; norms stay
// 1) with the experts drawn whole and sliced, so that the generator advances the same
// way whatever the ep size: an ep rank's experts equal the reference's slice.
inline void init_moe_decoder_weights(torch::nn::Module& decoder, int64_t layers) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * std::max<int64_t>(layers, 1));
  auto init_own_parameters = [&](const std::string& prefix, torch::nn::Module& module) {
    if (auto* experts = module.as<ExpertsImpl>()) {
      experts->init_normal(0.02, residual_std);  // w2 is the residual output
      return;
    }
    for (auto& param : module.named_parameters(/*recurse=*/false)) {
      if (param.value().dim() < 2) continue;
      const std::string name = prefix + param.key();
      const bool residual_out = name.ends_with("attn.wo.weight") || name.ends_with("mlp.w2.weight");
      param.value().normal_(0.0, residual_out ? residual_std : 0.02);
    }
  };
  // Without the decoder itself in named_modules: it may still be under construction.
  init_own_parameters("", decoder);
  for (const auto& module : decoder.named_modules("", /*include_self=*/false)) {
    init_own_parameters(module.key() + ".", *module.value());
  }
}

struct MoETransformerImpl : torch::nn::Module {
  // ep_group: the expert-parallel group (null: all experts on this rank).
  explicit MoETransformerImpl(const MoETransformerConfig& config, GroupPtr ep_group = nullptr)
      : config(checked(config)) {
    const TransformerConfig& base = config.transformer;
    tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(base.vocab, base.dim));
    pos_embeddings =
        register_module("pos_embeddings", torch::nn::Embedding(base.max_seq, base.dim));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < base.layers; ++i) {
      layers.emplace_back(MoEDecoderBlock(config, config.is_moe_layer(i), ep_group));
      list->push_back(layers.back().ptr());
    }
    norm = register_module("norm", RMSNorm(base.dim));
    init_moe_decoder_weights(*this, base.layers);
  }

  // tokens [B, T] int64, T <= max_seq. Returns logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2, "MoETransformer expects tokens [batch, seq], got ",
                tokens.sizes());
    TORCH_CHECK(tokens.size(1) <= config.transformer.max_seq, "sequence length ", tokens.size(1),
                " exceeds max_seq ", config.transformer.max_seq);
    at::Tensor positions = torch::arange(tokens.size(1), tokens.options());
    at::Tensor h = tok_embeddings(tokens) + pos_embeddings(positions);
    for (auto& layer : layers) h = layer(h);
    return torch::nn::functional::linear(norm(h), tok_embeddings->weight);  // tied output
  }

  // The MoE layers' load-balancing losses of the last forward, summed (a zero without
  // graph when load_balance_coef is 0).
  at::Tensor aux_loss() const {
    at::Tensor total = torch::zeros({});
    for (const auto& layer : layers) {
      if (layer->moe) total = total + layer->moe->aux_loss();
    }
    return total;
  }

  MoETransformerConfig config;
  torch::nn::Embedding tok_embeddings{nullptr}, pos_embeddings{nullptr};
  std::vector<hp::Sharded<MoEDecoderBlock>> layers;
  RMSNorm norm{nullptr};

 private:
  static const MoETransformerConfig& checked(const MoETransformerConfig& config) {
    config.validate();
    return config;
  }
};
TORCH_MODULE(MoETransformer);

}  // namespace hp::models

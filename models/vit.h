#pragma once
// A small Vision Transformer (ViT) for tests: a patch embedding (Conv2d with
// stride = patch), a learned CLS token prepended to the patch tokens, a learned position
// embedding, pre-norm encoder blocks (LayerNorm -> multi-head self-attention -> residual,
// LayerNorm -> GELU MLP -> residual), a final LayerNorm and a linear classification head
// on the CLS token. With num_classes == 0 there is no head and forward returns the
// normalized tokens, for use as an image encoder (models/multimodal.h).
//
// The blocks are declared Sharded<...>: without fully_shard they are plain modules, so
// the same class is also the single-process reference. They are also registered in a
// ModuleList "blocks", so parameters are named "blocks.0.attn.qkv.weight" and so on.

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/fully_shard.h"

namespace hp::models {

struct VitConfig {
  int64_t image_size = 224;
  int64_t patch_size = 16;
  int64_t channels = 3;
  int64_t dim = 256;
  int64_t heads = 4;
  int64_t layers = 6;
  int64_t mlp_hidden = 1024;
  int64_t num_classes = 10;  // 0: no head, forward returns the tokens

  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int64_t num_tokens() const { return num_patches() + 1; }  // patches and CLS

  void validate() const {
    auto require = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument("VitConfig: " + what);
    };
    require(image_size > 0 && patch_size > 0 && channels > 0 && dim > 0 && heads > 0 &&
                layers >= 0 && mlp_hidden > 0 && num_classes >= 0,
            "sizes must be positive (layers and num_classes may be 0)");
    require(image_size % patch_size == 0, "image_size (" + std::to_string(image_size) +
                                              ") must be divisible by patch_size (" +
                                              std::to_string(patch_size) + ")");
    require(dim % heads == 0, "dim (" + std::to_string(dim) + ") must be divisible by heads (" +
                                  std::to_string(heads) + ")");
  }
};

// Bidirectional multi-head self-attention (no mask: every patch sees every patch).
struct VitAttentionImpl : torch::nn::Module {
  VitAttentionImpl(int64_t dim, int64_t heads)
      : heads(heads),
        head_dim(dim / heads),
        qkv(register_module("qkv", torch::nn::Linear(dim, 3 * dim))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t batch = x.size(0), seq = x.size(1);
    // [B, T, 3, H, hd] -> [3, B, H, T, hd]
    at::Tensor qkv_heads = qkv(x).view({batch, seq, 3, heads, head_dim}).permute({2, 0, 3, 1, 4});
    at::Tensor q = qkv_heads[0], k = qkv_heads[1], v = qkv_heads[2];
    at::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(head_dim));
    at::Tensor out = torch::matmul(torch::softmax(scores, -1), v);
    return proj(out.transpose(1, 2).reshape({batch, seq, -1}));
  }

  int64_t heads, head_dim;
  torch::nn::Linear qkv, proj;
};
TORCH_MODULE(VitAttention);

struct VitMlpImpl : torch::nn::Module {
  VitMlpImpl(int64_t dim, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(VitMlp);

inline torch::nn::LayerNorm layer_norm(int64_t dim) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
}

struct EncoderBlockImpl : torch::nn::Module {
  explicit EncoderBlockImpl(const VitConfig& config)
      : norm1(register_module("norm1", layer_norm(config.dim))),
        attn(register_module("attn", VitAttention(config.dim, config.heads))),
        norm2(register_module("norm2", layer_norm(config.dim))),
        mlp(register_module("mlp", VitMlp(config.dim, config.mlp_hidden))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attn(norm1(x));
    return h + mlp(norm2(h));
  }
  torch::nn::LayerNorm norm1;
  VitAttention attn;
  torch::nn::LayerNorm norm2;
  VitMlp mlp;
};
TORCH_MODULE(EncoderBlock);

struct VisionTransformerImpl : torch::nn::Module {
  explicit VisionTransformerImpl(const VitConfig& config) : config(checked(config)) {
    patch_embed = register_module(
        "patch_embed",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(config.channels, config.dim, config.patch_size)
                              .stride(config.patch_size)));
    cls_token = register_parameter("cls_token", torch::zeros({config.dim}));
    pos_embed = register_parameter("pos_embed", torch::zeros({config.num_tokens(), config.dim}));
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < config.layers; ++i) {
      blocks.emplace_back(EncoderBlock(config));
      list->push_back(blocks.back().ptr());
    }
    norm = register_module("norm", layer_norm(config.dim));
    if (config.num_classes > 0) {
      head = register_module("head", torch::nn::Linear(config.dim, config.num_classes));
    }
    init_weights();
  }

  // images: [B, channels, image_size, image_size]. Returns logits [B, num_classes], or
  // with num_classes == 0 the normalized tokens [B, num_tokens, dim] (CLS first).
  at::Tensor forward(const at::Tensor& images) {
    TORCH_CHECK(images.dim() == 4 && images.size(1) == config.channels &&
                    images.size(2) == config.image_size && images.size(3) == config.image_size,
                "VisionTransformer expects images [batch, ", config.channels, ", ",
                config.image_size, ", ", config.image_size, "], got ", images.sizes());
    const int64_t batch = images.size(0);
    at::Tensor patches = patch_embed(images).flatten(2).transpose(1, 2);  // [B, N, dim]
    at::Tensor cls = cls_token.view({1, 1, config.dim}).expand({batch, 1, config.dim});
    at::Tensor h = torch::cat({cls, patches}, 1) + pos_embed;
    for (auto& block : blocks) h = block(h);
    h = norm(h);
    return head ? head(h.select(1, 0)) : h;
  }

  VitConfig config;
  torch::nn::Conv2d patch_embed{nullptr};
  at::Tensor cls_token, pos_embed;
  std::vector<hp::Sharded<EncoderBlock>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  static const VitConfig& checked(const VitConfig& config) {
    config.validate();
    return config;
  }

  // Weights, CLS token and position embedding N(0, 0.02), biases 0, LayerNorm 1 / 0
  // (as in timm), so the initial logits are small. Draws from the global generator in
  // parameter order, so torch::manual_seed fixes the result.
  void init_weights() {
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      at::Tensor& param = item.value();
      if (name.ends_with("bias")) {
        param.zero_();
      } else if (param.dim() >= 2 || name == "cls_token") {
        param.normal_(0.0, 0.02);
      }
    }
  }
};
TORCH_MODULE(VisionTransformer);

}  // namespace hp::models

#pragma once
// A small vision-language model for tests (LLaVA-style "deep stack"): a ViT image
// encoder (models/vit.h, no head) -> a 2-layer projection MLP into the decoder's width ->
// a decoder-only transformer (the Llama-style blocks of models/transformer.h) that reads
// the projected image tokens followed by the text tokens, causally, and predicts the
// next text token.
//
// The encoder, the decoder and their blocks are declared Sharded<...>, so the two
// sub-models can be fully_shard-ed independently; without fully_shard they are plain
// modules and the same class is the single-process reference. Parameters are named
// "vision.blocks.0....", "projector.fc1.weight", "decoder.layers.0....".

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "hyperparallel/fully_shard.h"
#include "models/transformer.h"
#include "models/vit.h"

namespace hp::models {

struct MultimodalConfig {
  VitConfig vision;        // num_classes must be 0: the encoder hands over its tokens
  TransformerConfig text;  // text.max_seq: the longest text; layers: the decoder blocks

  void validate() const {
    vision.validate();
    text.validate();
    if (vision.num_classes != 0) {
      throw std::invalid_argument("MultimodalConfig: vision.num_classes must be 0 (got " +
                                  std::to_string(vision.num_classes) + ")");
    }
  }
};

// Image tokens (vision width) -> decoder width.
struct ProjectorImpl : torch::nn::Module {
  ProjectorImpl(int64_t in, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, out))),
        fc2(register_module("fc2", torch::nn::Linear(out, out))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Projector);

// Decoder over [prefix embeddings; text token embeddings] with a learned position
// embedding, causal blocks, a final RMSNorm and an output projection tied to the token
// embedding; logits only for the text positions.
struct PrefixDecoderImpl : torch::nn::Module {
  PrefixDecoderImpl(const TransformerConfig& config, int64_t max_prefix)
      : config(config), max_prefix(max_prefix) {
    config.validate();
    tok_embeddings =
        register_module("tok_embeddings", torch::nn::Embedding(config.vocab, config.dim));
    pos_embeddings = register_module("pos_embeddings",
                                     torch::nn::Embedding(max_prefix + config.max_seq, config.dim));
    layers = register_decoder_layers(*this, config);
    norm = register_module("norm", RMSNorm(config.dim));
    init_weights();
  }

  // prefix: [B, P, dim], P <= max_prefix; tokens: [B, T] int64, T <= max_seq. Returns
  // logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& prefix, const at::Tensor& tokens) {
    TORCH_CHECK(prefix.dim() == 3 && prefix.size(2) == config.dim && prefix.size(1) <= max_prefix,
                "PrefixDecoder expects a prefix [batch, <= ", max_prefix, ", ", config.dim,
                "], got ", prefix.sizes());
    TORCH_CHECK(
        tokens.dim() == 2 && tokens.size(0) == prefix.size(0) && tokens.size(1) <= config.max_seq,
        "PrefixDecoder expects tokens [", prefix.size(0), ", <= ", config.max_seq, "], got ",
        tokens.sizes());
    const int64_t prefix_len = prefix.size(1), text_len = tokens.size(1);
    at::Tensor positions = torch::arange(prefix_len + text_len, tokens.options());
    at::Tensor h = torch::cat({prefix, tok_embeddings(tokens)}, 1) + pos_embeddings(positions);
    for (auto& layer : layers) h = layer(h);
    at::Tensor text = norm(h.narrow(1, prefix_len, text_len));
    return torch::nn::functional::linear(text, tok_embeddings->weight);
  }

  TransformerConfig config;
  int64_t max_prefix;
  torch::nn::Embedding tok_embeddings{nullptr}, pos_embeddings{nullptr};
  std::vector<hp::Sharded<DecoderBlock>> layers;
  RMSNorm norm{nullptr};

 private:
  void init_weights() { init_decoder_weights(*this, config.layers); }
};
TORCH_MODULE(PrefixDecoder);

struct VisionLanguageModelImpl : torch::nn::Module {
  explicit VisionLanguageModelImpl(const MultimodalConfig& config)
      : config(checked(config)),
        vision(register_module("vision", VisionTransformer(config.vision))),
        projector(register_module("projector", Projector(config.vision.dim, config.text.dim))),
        decoder(
            register_module("decoder", PrefixDecoder(config.text, config.vision.num_tokens()))) {}

  // images: [B, channels, image_size, image_size]; tokens: [B, T]. Returns the logits of
  // the text positions [B, T, vocab].
  at::Tensor forward(const at::Tensor& images, const at::Tensor& tokens) {
    return decoder(projector(vision(images)), tokens);
  }

  MultimodalConfig config;
  hp::Sharded<VisionTransformer> vision;
  Projector projector;
  hp::Sharded<PrefixDecoder> decoder;

 private:
  static const MultimodalConfig& checked(const MultimodalConfig& config) {
    config.validate();
    return config;
  }
};
TORCH_MODULE(VisionLanguageModel);

}  // namespace hp::models

// Test plan L3-05 (chunked cross-entropy with a large vocabulary), 2 ranks: the 2-layer
// decoder of models/transformer.h with vocab 32768 and its tied output projection, the
// cross-entropy computed in chunks of 512 tokens, FSDP 1-D against the single-process run
// of the same model on the global batch; two AdamW steps, after each backward:
//   total loss (mean over ranks)                 within 1e-5 of the reference's;
//   each chunk's mean loss                       within 1e-5 of the reference's chunk;
//   sum of the per-chunk losses == total loss    within 1e-6, on every rank and in the
//                                                reference; at the first step the
//                                                reference's chunked loss also equals its
//                                                unchunked one within 1e-6;
//   global grad norm, output-layer (tied embedding) grad norm and every gradient
//                                                within 1e-5.
// The sharded model recomputes each chunk (the reference does not), so that its backward
// too holds one chunk's logits at a time.
#include <malloc.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/recompute.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

constexpr int64_t kChunk = 512;  // tokens per cross-entropy chunk

// The language model with its loss inside forward: the output projection (the root's tied
// embedding) runs inside the root's forward, while fully_shard has the root unsharded.
struct ChunkedCeLmImpl : torch::nn::Module {
  explicit ChunkedCeLmImpl(const TransformerConfig& config)
      : lm(register_module("lm", Transformer(config))) {}

  // tokens, targets: [B, T] with B * T a multiple of kChunk. Returns the summed
  // cross-entropy of each chunk of kChunk consecutive tokens of the flattened batch,
  // [B * T / kChunk]. Only one chunk's [kChunk, vocab] logits exist at a time.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets) {
    at::Tensor hidden = lm->hidden(tokens).reshape({-1, lm->config.dim});
    at::Tensor flat_targets = targets.reshape(-1);
    TORCH_CHECK(hidden.size(0) % kChunk == 0, "tokens (", hidden.size(0),
                ") must be a multiple of the chunk size ", kChunk);
    std::vector<at::Tensor> sums;
    for (int64_t start = 0; start < hidden.size(0); start += kChunk) {
      at::Tensor chunk_targets = flat_targets.narrow(0, start, kChunk);
      auto chunk_loss = [chunk_targets](const std::vector<at::Tensor>& in) {
        at::Tensor logits = in[0].matmul(in[1].t());
        return std::vector{torch::nn::functional::cross_entropy(
            logits, chunk_targets,
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))};
      };
      // Without recomputation autograd keeps every chunk's log-probabilities for backward.
      const std::vector<at::Tensor> in{hidden.narrow(0, start, kChunk), lm->tok_embeddings->weight};
      sums.push_back(recompute_chunks ? recompute(chunk_loss, in, {.impl = *recompute_chunks})[0]
                                      : chunk_loss(in)[0]);
    }
    return torch::stack(sums);
  }

  Transformer lm;
  std::optional<RecomputeImpl> recompute_chunks;
};
TORCH_MODULE(ChunkedCeLm);

struct ChunkedLoss {
  at::Tensor total;        // mean over the tokens, what backward starts from
  at::Tensor chunk_means;  // [chunks]
};

// Model: ChunkedCeLm, or Sharded<ChunkedCeLm> whose call runs fully_shard's hooks. The
// chunk sums are added in double: 1e-6 is about one fp32 ulp of a loss near log(32768).
template <typename Model>
ChunkedLoss chunked_loss(Model& model, const at::Tensor& input, const at::Tensor& target) {
  at::Tensor sums = model(input, target).to(at::kDouble);
  return {sums.sum() / target.numel(), sums.detach() / kChunk};
}

// The per-chunk losses, weighted by their share of the tokens, add up to the total.
void expect_chunks_add_up(const ChunkedLoss& loss, const std::string& who) {
  const double chunk_share = 1.0 / static_cast<double>(loss.chunk_means.size(0));
  EXPECT_NEAR((loss.chunk_means * chunk_share).sum().item<double>(), loss.total.item<double>(),
              1e-6)
      << who << ": sum of the chunk losses";
}

HP_DIST_TEST_WITH_TIMEOUT(FullyShardChunkedCe, L3_05_ChunkedCrossEntropyFsdp1D, 300, 2) {
  // Keep freed blocks of the 64 MiB logits for reuse: returned to the system, each new one
  // costs more in page faults than its matmul.
  mallopt(M_MMAP_THRESHOLD, 512 << 20);
  mallopt(M_TRIM_THRESHOLD, 1024 << 20);
  auto world = testing::world();
  const TransformerConfig config{
      .vocab = 32768, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 256, .max_seq = 256};
  // 8 x 256 tokens: 4 chunks in the reference, 2 per rank (rank r has the reference's
  // chunks 2r and 2r + 1); each chunk spans two sequences.
  const int64_t global_batch = 8;
  auto [reference, model] = testing::build_from_seed<ChunkedCeLm>(42, config);
  model->recompute_chunks = RecomputeImpl::kNonReentrant;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->lm->layers, model, "lm.layers.");
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const std::string output_weight = "lm.tok_embeddings.weight";

  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(config.vocab, {global_batch, config.max_seq + 1});
    at::Tensor input = tokens.narrow(1, 0, config.max_seq);
    at::Tensor target = tokens.narrow(1, 1, config.max_seq);
    ref_opt.zero_grad();
    opt.zero_grad();
    const ChunkedLoss ref_loss = chunked_loss(reference, input, target);
    ref_loss.total.backward();
    const ChunkedLoss loss =
        chunked_loss(model, testing::local_batch(input, world->rank(), world->size()),
                     testing::local_batch(target, world->rank(), world->size()));
    loss.total.backward();

    EXPECT_NEAR(testing::mean_over_ranks(loss.total).item<double>(), ref_loss.total.item<double>(),
                1e-5)
        << "total loss";
    const int64_t chunks = loss.chunk_means.size(0);
    at::Tensor ref_chunks = ref_loss.chunk_means.narrow(0, world->rank() * chunks, chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      EXPECT_NEAR(loss.chunk_means[c].item<double>(), ref_chunks[c].item<double>(), 1e-5)
          << "chunk " << c;
    }
    expect_chunks_add_up(loss, "rank");
    expect_chunks_add_up(ref_loss, "reference");
    if (step == 0) {  // the chunking is the same at every step
      torch::NoGradGuard no_grad;
      EXPECT_NEAR(testing::token_cross_entropy(reference->lm(input), target).item<double>(),
                  ref_loss.total.item<double>(), 1e-6)
          << "unchunked loss of the reference";
    }

    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters with a gradient";
    EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(ref_grads), 1e-5) << "grad norm";
    EXPECT_NEAR(testing::norm_of({{output_weight, grads.at(output_weight)}}),
                testing::norm_of({{output_weight, ref_grads.at(output_weight)}}), 1e-5)
        << "output-layer grad norm";
    testing::expect_all_close(grads, ref_grads, 1e-5, "grad");

    ref_opt.step();
    opt.step();
  }
}

}  // namespace
}  // namespace hp

// Sharded checkpoints written by a thread of their own while training goes on: the calling
// thread takes the snapshot (a forked writer, or a copy in host memory); the writer thread
// runs the save's protocol over a group of its own.
#include "hyperparallel/async_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <exception>
#include <numeric>
#include <thread>
#include <utility>

#include "../distributed/error_message.h"
#include "checkpoint_writing.h"
#include "forked_writer.h"

namespace hp {
namespace detail {

constexpr const char* kCaller = "AsyncCheckpointSaver::save";

class AsyncCheckpointWriter {
 public:
  explicit AsyncCheckpointWriter(CheckpointStaging staging) : staging_(staging) {}
  ~AsyncCheckpointWriter() { finish(); }

  // The group the writer agrees over: all ranks of `world`, made once (null: alone).
  const Group* group_for(const std::shared_ptr<World>& world) {
    if (!world || world->size() == 1) return nullptr;
    if (!group_ || world_.lock() != world) {
      // Savers are made in the same order on every rank, so the names match.
      static std::atomic<int64_t> groups_made{0};
      std::vector<int64_t> ranks(world->size());
      std::iota(ranks.begin(), ranks.end(), 0);
      group_ = world->new_group("checkpoint_writer_" + std::to_string(groups_made++), ranks);
      world_ = world;
    }
    return group_.get();
  }

  // Takes the snapshot of `pieces` and starts writing it into `dir`.
  void start(const std::string& dir, std::vector<RankPiece> pieces, const Group* group) {
    const bool on_cpu = std::all_of(pieces.begin(), pieces.end(),
                                    [](const RankPiece& piece) { return piece.tensor.is_cpu(); });
    std::function<void(const std::string&)> write_this_rank;
    if (staging_ == CheckpointStaging::kFork && on_cpu) {
      // Contiguous here: the child must not run kernels (their thread pools do not survive
      // a fork).
      for (RankPiece& piece : pieces) piece.tensor = piece.tensor.contiguous();
      const std::string path = staged_rank_file(dir, group);
      forked_ = std::make_unique<ForkedWriter>(
          [path, pieces = std::move(pieces)] { write_rank_file(path, pieces); }, path);
      write_this_rank = [this](const std::string&) { forked_->write(); };
    } else {
      stage(pieces);
      write_this_rank = [this](const std::string& path) { write_rank_file(path, staged_); };
    }
    busy_ = true;
    thread_ = std::thread([this, dir, group, write_this_rank = std::move(write_this_rank)] {
      try {
        write_checkpoint(dir, write_this_rank, group, kCaller);
      } catch (const std::exception&) {
        error_ = std::current_exception();
      }
      forked_.reset();  // a writer never let write (an earlier step failed) exits
      busy_ = false;
    });
  }

  // Waits for the save in flight; its failure, if any (once).
  std::exception_ptr finish() {
    if (thread_.joinable()) thread_.join();
    return std::exchange(error_, nullptr);
  }

  bool busy() const { return busy_; }

 private:
  // Copies `pieces` into the staging memory, reusing the buffers of the previous save
  // where shape and dtype match. Pinned when the pieces are on a GPU.
  void stage(const std::vector<RankPiece>& pieces) {
    staged_.resize(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      const at::Tensor& from = pieces[i].tensor;
      RankPiece& to = staged_[i];
      if (!to.tensor.defined() || to.tensor.sizes() != from.sizes() ||
          to.tensor.scalar_type() != from.scalar_type()) {
        to.tensor =
            at::empty(from.sizes(),
                      at::TensorOptions().dtype(from.scalar_type()).pinned_memory(from.is_cuda()));
      }
      to.tensor.copy_(from);
      to.name = pieces[i].name;
      to.offsets = pieces[i].offsets;
      to.whole_shape = pieces[i].whole_shape;
    }
  }

  CheckpointStaging staging_;
  std::vector<RankPiece> staged_;
  std::unique_ptr<ForkedWriter> forked_;
  GroupPtr group_;
  std::weak_ptr<World> world_;
  std::thread thread_;
  std::atomic<bool> busy_{false};
  std::exception_ptr error_;
};

}  // namespace detail

AsyncCheckpointSaver::AsyncCheckpointSaver(CheckpointStaging staging)
    : writer_(std::make_unique<detail::AsyncCheckpointWriter>(staging)) {}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (const std::exception_ptr error = writer_->finish()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& failure) {
      TORCH_WARN("AsyncCheckpointSaver: the last save failed and nobody waited for it: ",
                 detail::message_of(failure));
    }
  }
}

void AsyncCheckpointSaver::save(const std::string& dir, torch::nn::Module& model,
                                torch::optim::Optimizer* optimizer, const StateDict& extra) {
  wait();
  detail::RankSave save = detail::rank_save(model, optimizer, extra, detail::kCaller);
  const Group* group = writer_->group_for(save.world);
  writer_->start(dir, std::move(save.pieces), group);
}

void AsyncCheckpointSaver::wait() {
  if (const std::exception_ptr error = writer_->finish()) std::rethrow_exception(error);
}

bool AsyncCheckpointSaver::busy() const { return writer_->busy(); }

}  // namespace hp

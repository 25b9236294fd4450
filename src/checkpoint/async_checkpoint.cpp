// Sharded checkpoints written by a thread of their own while training goes on: the calling
// thread stages this rank's pieces in host memory; the writer thread runs the save's
// protocol over a group of its own.
#include "hyperparallel/async_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <exception>
#include <numeric>
#include <thread>
#include <utility>

#include "../distributed/error_message.h"
#include "checkpoint_writing.h"

namespace hp {
namespace detail {

constexpr const char* kCaller = "AsyncCheckpointSaver::save";

class AsyncCheckpointWriter {
 public:
  ~AsyncCheckpointWriter() { finish(); }

  // Copies `pieces` into the staging memory, reusing the buffers of the previous save
  // where shape and dtype match. Host memory: pinned when the pieces are on a GPU.
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

  void start(std::string dir, const Group* group) {
    busy_ = true;
    thread_ = std::thread([this, dir = std::move(dir), group] {
      try {
        write_checkpoint(dir, staged_, group, kCaller);
      } catch (const std::exception&) {
        error_ = std::current_exception();
      }
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
  std::vector<RankPiece> staged_;
  GroupPtr group_;
  std::weak_ptr<World> world_;
  std::thread thread_;
  std::atomic<bool> busy_{false};
  std::exception_ptr error_;
};

}  // namespace detail

AsyncCheckpointSaver::AsyncCheckpointSaver()
    : writer_(std::make_unique<detail::AsyncCheckpointWriter>()) {}

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
  c10::NoGradGuard no_grad;
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  // Checked before the first collective, so that all ranks throw or none does.
  for (const auto& p : params) {
    if (p.shard) detail::require_sharded(*p.shard, p.name, detail::kCaller);
  }
  const std::shared_ptr<World> world = detail::world_of(params, detail::kCaller);
  const Group* group = writer_->group_for(world);
  writer_->stage(
      detail::pieces_of_rank(params, model, optimizer, extra, !world || world->rank() == 0));
  writer_->start(dir, group);
}

void AsyncCheckpointSaver::wait() {
  if (const std::exception_ptr error = writer_->finish()) std::rethrow_exception(error);
}

bool AsyncCheckpointSaver::busy() const { return writer_->busy(); }

}  // namespace hp

#include "hyperparallel/activation_swap.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../recompute/saved_tensor_hooks.h"
#include "swap_file.h"
#include "swapped_storage.h"

namespace hp {
namespace detail {
namespace {

// The backward (autograd graph task) running on this thread; -1 outside backward.
int current_backward() { return torch::autograd::get_current_graph_task_id(); }

}  // namespace

// One storage swapped out, shared by the saved tensors that view it (in any region).
struct SwapEntry {
  SwapEntry(std::unique_ptr<SwappedStorage> swapped_in, const at::Tensor& saved)
      : swapped(std::move(swapped_in)),
        source(saved.storage().getWeakStorageImpl()),
        version(saved._version()),
        bytes(static_cast<int64_t>(saved.storage().nbytes())) {}

  std::unique_ptr<SwappedStorage> swapped;
  // Holds the storage's address (not its memory) while the entry lives, so that a saved
  // tensor viewing it is recognised by its address.
  c10::weak_intrusive_ptr<c10::StorageImpl> source;
  int64_t version;  // of the saved tensor whose bytes were copied
  int64_t bytes;
  int packs = 0;     // saved tensors viewing it
  int unpacked = 0;  // of those, unpacked since it was last brought back
};

// What one SwapActivations swapped. Backward needs the region that swapped before it
// (`previous`) next.
struct SwapRegion {
  std::weak_ptr<SwapRegion> previous;
  // The storages its saved tensors view, in the order forward saved them.
  std::vector<std::shared_ptr<SwapEntry>> entries;
  std::unordered_set<const SwapEntry*> has;
  std::optional<int> reached_in;  // the backward that needed it last
  std::optional<int> loaded_in;   // the backward that brought it back last
};

class ActivationSwapState {
 public:
  explicit ActivationSwapState(ActivationSwapOptions options_in)
      : options(std::move(options_in)), directory_(options.directory) {
    TORCH_CHECK_VALUE(options.min_bytes >= 0, "ActivationSwapOptions::min_bytes must be >= 0, got ",
                      options.min_bytes);
    TORCH_CHECK_VALUE(options.prefetch_regions >= 0,
                      "ActivationSwapOptions::prefetch_regions must be >= 0, got ",
                      options.prefetch_regions);
    if (directory_.empty()) {
      const char* tmpdir = std::getenv("TMPDIR");
      directory_ = tmpdir && *tmpdir ? tmpdir : "/tmp";
    }
  }

  const ActivationSwapOptions options;

  bool swappable(const at::Tensor& t) const {
    if (t.layout() != at::kStrided || !t.has_storage() || t.is_nested() || t._is_zerotensor() ||
        t.is_quantized() || t.is_conj() || t.is_neg()) {
      return false;  // what a fresh storage and its view would not bring back as it was
    }
    if (!t.device().is_cpu() && !t.device().is_cuda()) return false;
    const auto bytes = static_cast<int64_t>(t.storage().nbytes());
    if (bytes == 0 || bytes < options.min_bytes) return false;
    // Parameters and views of them: fully_shard frees and gathers them itself, and
    // unsharded ones are weights, not activations.
    const at::TensorBase& base = t.is_view() ? t._base() : t;
    return !(base.is_leaf() && base.requires_grad());
  }

  void note_kept() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.tensors_kept;
  }

  // The entry holding t's storage, copied out now unless it was already (at t's version).
  std::shared_ptr<SwapEntry> swap_out(const std::shared_ptr<SwapRegion>& region,
                                      const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    const c10::Storage& storage = t.storage();
    std::weak_ptr<SwapEntry>& slot = swapped_[storage.unsafeGetStorageImpl()];
    std::shared_ptr<SwapEntry> entry = slot.lock();
    if (!entry || entry->version != t._version()) {
      entry = std::make_shared<SwapEntry>(t.device().is_cpu()
                                              ? swap_to_file(storage, file())
                                              : swap_to_host(storage, side_stream(t.device())),
                                          t);
      slot = entry;  // an older version's entry lives on in the hooks that hold it
      ++stats_.storages_swapped;
      stats_.bytes_swapped_out += entry->bytes;
    }
    if (region->has.insert(entry.get()).second) {
      if (region->entries.empty()) {  // regions that swap nothing stay out of the order
        region->previous = last_region_;
        last_region_ = region;
      }
      region->entries.push_back(entry);
    }
    ++entry->packs;
    ++stats_.tensors_swapped;
    forget_dead_entries();
    return entry;
  }

  // The entry's storage back on its device. The first time a backward needs a region, it
  // loads the region (on demand) and the ones it will need next (prefetch).
  c10::Storage bring_back(SwapRegion& region, SwapEntry& entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int backward = current_backward();
    if (region.reached_in != backward) {
      region.reached_in = backward;
      load(region, backward, stats_.loads_on_demand);
      auto ahead = region.previous.lock();
      for (int i = 0; i < options.prefetch_regions && ahead; ++i) {
        load(*ahead, backward, stats_.loads_prefetched);
        ahead = ahead->previous.lock();
      }
    }
    if (entry.swapped->load()) {  // back and dropped in this backward already: unpacked twice
      ++stats_.loads_on_demand;
      stats_.bytes_swapped_in += entry.bytes;
    }
    ++(entry.swapped->loaded() ? stats_.unpacks_ready : stats_.unpacks_waited);
    c10::Storage storage = entry.swapped->wait();
    if (++entry.unpacked == entry.packs) {  // every saved tensor has its copy: free ours
      entry.swapped->drop();
      entry.unpacked = 0;
    }
    return storage;
  }

  ActivationSwapStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  // Issues the loads of a region's storages, in the order backward needs them (the last
  // saved first), once per backward.
  void load(SwapRegion& region, int backward, int64_t& counter) {
    if (region.loaded_in == backward) return;
    region.loaded_in = backward;
    for (auto it = region.entries.rbegin(); it != region.entries.rend(); ++it) {
      if ((*it)->swapped->load()) {
        ++counter;
        stats_.bytes_swapped_in += (*it)->bytes;
      }
    }
  }

  // Drops the addresses of storages whose entries are gone, once there are twice as many
  // addresses as there were at the last sweep.
  void forget_dead_entries() {
    if (swapped_.size() < sweep_at_) return;
    std::erase_if(swapped_, [](const auto& item) { return item.second.expired(); });
    sweep_at_ = std::max<size_t>(2 * swapped_.size(), 64);
  }

  const std::shared_ptr<SwapFile>& file() {
    if (!file_) file_ = std::make_shared<SwapFile>(directory_);
    return file_;
  }

  c10::Stream side_stream(c10::Device device) {
    auto found = side_streams_.find(device.index());
    if (found == side_streams_.end()) {
      const c10::impl::VirtualGuardImpl impl(device.type());
      found = side_streams_.emplace(device.index(), impl.getStreamFromGlobalPool(device)).first;
    }
    return found->second;
  }

  std::string directory_;
  mutable std::mutex mutex_;
  std::weak_ptr<SwapRegion> last_region_;
  std::unordered_map<c10::StorageImpl*, std::weak_ptr<SwapEntry>> swapped_;
  size_t sweep_at_ = 64;
  std::shared_ptr<SwapFile> file_;
  std::map<c10::DeviceIndex, c10::Stream> side_streams_;
  ActivationSwapStats stats_;
};

namespace {

// One saved tensor: kept as it is, or a view of a swapped storage.
class SwapHooks final : public torch::autograd::SavedVariableHooks {
 public:
  SwapHooks(std::shared_ptr<ActivationSwapState> state, std::shared_ptr<SwapRegion> region)
      : state_(std::move(state)), region_(std::move(region)) {}

  void call_pack_hook(const at::Tensor& t) override {
    version_ = t.unsafeGetTensorImpl()->version_counter();
    saved_version_ = version_.current_version();
    options_ = t.options();
    sizes_ = t.sizes().vec();
    if (!state_->swappable(t)) {
      // Detached: holding an output itself would make a cycle through its grad_fn.
      kept_ = t.detach();
      state_->note_kept();
      return;
    }
    strides_ = t.strides().vec();
    storage_offset_ = t.storage_offset();
    entry_ = state_->swap_out(region_, t);
  }

  at::Tensor call_unpack_hook() override {
    // Autograd checks this only for tensors saved without hooks.
    const uint32_t now = version_.current_version();
    if (now != saved_version_) {
      std::ostringstream what;
      what << "activation swap: a tensor saved for backward (" << c10::IntArrayRef(sizes_) << " "
           << options_.dtype() << ") was modified in place after it was saved (version "
           << saved_version_ << ", now " << now
           << "); backward would use the wrong values. Without swap autograd refuses this "
              "too (\"modified by an inplace operation\"): modify a clone instead";
      C10_THROW_ERROR(Error, what.str());
    }
    if (!entry_) return kept_;
    const c10::Storage storage = state_->bring_back(*region_, *entry_);
    return at::empty({0}, options_).set_(storage, storage_offset_, sizes_, strides_);
  }

 private:
  std::shared_ptr<ActivationSwapState> state_;
  std::shared_ptr<SwapRegion> region_;
  c10::VariableVersion version_;
  uint32_t saved_version_ = 0;
  at::Tensor kept_;
  std::shared_ptr<SwapEntry> entry_;
  at::TensorOptions options_;
  std::vector<int64_t> sizes_, strides_;
  int64_t storage_offset_ = 0;
};

}  // namespace
}  // namespace detail

ActivationSwap::ActivationSwap(ActivationSwapOptions options)
    : state_(std::make_shared<detail::ActivationSwapState>(std::move(options))) {}

const ActivationSwapOptions& ActivationSwap::options() const { return state_->options; }

ActivationSwapStats ActivationSwap::stats() const { return state_->stats(); }

SwapActivations::SwapActivations(const ActivationSwap& swap) {
  using Hooks = std::unique_ptr<torch::autograd::SavedVariableHooks>;
  if (detail::current_backward() != -1) {
    // A recompute's rerun: its tensors are thrown away or used at once.
    scope_ = std::make_unique<detail::SavedTensorHooksScope>([]() -> Hooks { return nullptr; });
    return;
  }
  auto region = std::make_shared<detail::SwapRegion>();
  scope_ =
      std::make_unique<detail::SavedTensorHooksScope>([state = swap.state_, region]() -> Hooks {
        return std::make_unique<detail::SwapHooks>(state, region);
      });
}

SwapActivations::~SwapActivations() = default;

}  // namespace hp

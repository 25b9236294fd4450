#pragma once
// Activation swap: the tensors autograd saves for backward inside a region (a layer's
// forward) leave the compute device during forward and come back before backward needs
// them. Backward brings a region back while it runs the region after it (prefetch), so
// the copies overlap with compute. It buys the memory of the regions' activations for a
// copy out and a copy in of each, where recomputation pays with a forward.
//
//   hp::ActivationSwap swap({.directory = "/local/ssd"});
//   for (auto& block : blocks) {
//     hp::SwapActivations region(swap);  // what block saves goes to `swap`
//     h = block(h);
//   }
//
// Where the bytes go: a GPU tensor's to pinned host memory (copies on a side stream,
// ordered against compute by events); a CPU tensor's, where host memory is the device,
// to a file on disk (unlinked at once, written in forward, read back ahead on a thread).
// The tensors come back on their device with their dtype, shape, strides and storage
// offset; saved tensors that view one storage share one copy.
//
// Composes with recompute: in a region that is also recomputed,
//   { hp::SwapActivations region(swap); h = hp::recompute(block, h); }
// the only tensors kept for backward are the recompute's inputs, and those are what is
// swapped; the rerun then runs on them, back on the compute device. Composes with
// fully_shard: parameters and views of them stay where they are (fully_shard frees and
// gathers them itself).

#include <cstdint>
#include <memory>
#include <string>

namespace hp {

namespace detail {
class ActivationSwapState;
class SavedTensorHooksScope;
}  // namespace detail

struct ActivationSwapOptions {
  // Where the swap file of CPU tensors is made; empty: $TMPDIR, else /tmp. Choose a local
  // disk: on a tmpfs the bytes stay in memory (no longer the process's, but the machine's).
  std::string directory;
  // Saved storages of fewer bytes stay where they are: the fixed cost of a copy (a system
  // call, a copy launch) outweighs the memory they hold.
  int64_t min_bytes = 16 * 1024;
  // Regions brought back ahead of the one backward is in. With 1, backward in region i
  // brings back region i - 1 (the one it needs next): at most two regions' swapped
  // tensors are back in memory at once. 0: a region comes back when backward first needs
  // one of its tensors (and waits for it).
  int prefetch_regions = 1;
};

// Counters since the ActivationSwap was made.
struct ActivationSwapStats {
  int64_t tensors_swapped = 0;    // saved tensors moved off their device
  int64_t tensors_kept = 0;       // saved tensors left in place (parameters, small, ...)
  int64_t storages_swapped = 0;   // storages they view, each copied out once
  int64_t bytes_swapped_out = 0;  // the bytes of those storages
  int64_t bytes_swapped_in = 0;   // bytes brought back (a storage each time it is loaded)
  int64_t loads_prefetched = 0;   // storages brought back because backward reached a later region
  int64_t loads_on_demand = 0;    // storages brought back because backward asked for them
  int64_t unpacks_ready = 0;      // saved tensors backward found back already
  int64_t unpacks_waited = 0;     // saved tensors backward had to wait for
};

// The swap of one model (or of any set of regions that run forward, then backward, in
// order): where the bytes go, and the regions in forward order, which backward follows in
// reverse to prefetch. Copies share it.
class ActivationSwap {
 public:
  explicit ActivationSwap(ActivationSwapOptions options = {});

  const ActivationSwapOptions& options() const;
  ActivationSwapStats stats() const;

 private:
  friend class SwapActivations;
  std::shared_ptr<detail::ActivationSwapState> state_;
};

// While it lives, the tensors autograd saves on this thread go to `swap`, as one region.
// Backward is expected to reach the regions in reverse order of their forward (the
// regions of one graph, or of several graphs backpropagated last first); another order
// is correct but prefetches the wrong regions. Inside a backward (a recompute's rerun)
// it swaps nothing: that graph is thrown away or backpropagated at once.
//
// Errors: a swap file that cannot be made or written (unwritable directory, full disk)
// throws c10::Error in forward, naming the file and the fix; a failed read throws in
// backward. A saved tensor modified in place after it was saved throws in backward, as
// autograd does without swap.
class SwapActivations {
 public:
  explicit SwapActivations(const ActivationSwap& swap);
  ~SwapActivations();
  SwapActivations(const SwapActivations&) = delete;
  SwapActivations& operator=(const SwapActivations&) = delete;

 private:
  std::unique_ptr<detail::SavedTensorHooksScope> scope_;
};

}  // namespace hp

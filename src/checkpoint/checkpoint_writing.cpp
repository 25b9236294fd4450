// What each rank of a sharded checkpoint writes, and the protocol that commits it.
#include "checkpoint_writing.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "checkpoint_index.h"
#include "durable_files.h"
#include "error_feedback_residuals.h"
#include "hyperparallel/collectives.h"
#include "safetensors_file.h"
#include "state_io.h"

namespace hp::detail {
namespace {

namespace fs = std::filesystem;

std::string rank_file(int64_t rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

// Collects what one rank writes.
struct PieceList {
  std::vector<RankPiece> pieces;

  void add(const std::string& name, const at::Tensor& tensor, std::vector<int64_t> offsets,
           std::vector<int64_t> whole_shape) {
    pieces.push_back({name, tensor.detach(), std::move(offsets), std::move(whole_shape)});
  }
  // A tensor this rank holds whole.
  void add_whole(const std::string& name, const at::Tensor& tensor) {
    add(name, tensor, std::vector<int64_t>(tensor.dim(), 0), tensor.sizes().vec());
  }
};

// What this rank writes: of the tensors kept whole, those named in `whole_written_here`;
// `extra` on rank 0. Pieces several ranks hold alike (a parameter that is not a parallel
// slice, on every rank of a tensor-parallel group) are indexed once.
std::vector<RankPiece> pieces_of_rank(const std::vector<ModelParam>& params,
                                      torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                      const StateDict& extra,
                                      const std::set<std::string>& whole_written_here,
                                      bool is_rank0) {
  PieceList pieces;
  for (const auto& p : params) {
    const std::optional<ParamOptimizerState> state =
        optimizer ? optimizer_state_of(*optimizer, p.variable) : std::nullopt;
    const std::string optim_name = kOptimizerPrefix + p.name + ".";
    // Where this rank's slice starts in the whole tensor (zeros: not a slice).
    std::vector<int64_t> slice_offsets(p.whole_shape.size(), 0);
    if (p.parallel_slice) {
      const Group& group = *p.parallel_slice->group;
      const int64_t dim = p.parallel_slice->dim;
      slice_offsets[dim] = group.rank() * (p.whole_shape[dim] / group.size());
    }
    if (!p.shard) {
      if (!p.parallel_slice && !whole_written_here.contains(p.name)) continue;
      pieces.add(p.name, p.variable, slice_offsets, p.whole_shape);
      if (!state) continue;
      for (const auto& [field, value] : state->fields) {
        pieces.add(optim_name + field, value, slice_offsets, p.whole_shape);
      }
      if (state->step)
        pieces.add_whole(optim_name + "step", at::scalar_tensor(*state->step, at::kLong));
      continue;
    }
    if (p.shard->replicate_group().rank() != 0) continue;
    const at::Tensor& local = p.shard->local();
    if (local.size(p.shard->shard_dim()) > 0) {
      std::vector<int64_t> offsets = slice_offsets;
      offsets[p.shard->shard_dim()] += p.shard->shard_offset();
      pieces.add(p.name, local, offsets, p.whole_shape);
      if (state) {
        for (const auto& [field, value] : state->fields) {
          pieces.add(optim_name + field, value, offsets, p.whole_shape);
        }
      }
    }
    if (state && state->step && p.shard->shard_group().rank() == 0) {
      pieces.add_whole(optim_name + "step", at::scalar_tensor(*state->step, at::kLong));
    }
  }
  for (const auto& item : model.named_buffers()) {
    if (whole_written_here.contains(item.key())) pieces.add_whole(item.key(), item.value());
  }
  if (is_rank0) {
    for (const auto& item : extra) pieces.add_whole(kExtraPrefix + item.key(), item.value());
  }
  return std::move(pieces.pieces);
}

// The names of the tensors this rank keeps whole: buffers, parameters neither sharded nor
// sliced.
std::vector<std::string> whole_tensor_names(const std::vector<ModelParam>& params,
                                            torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& p : params) {
    if (!p.shard && !p.parallel_slice) names.push_back(p.name);
  }
  for (const auto& item : model.named_buffers()) names.push_back(item.key());
  return names;
}

// Every member's `text`, in group-rank order (two all-gathers: the lengths, then the bytes).
std::vector<std::string> all_gather_text(const std::string& text, const Group& group) {
  at::Tensor lengths = at::empty({group.size()}, at::kLong);
  all_gather(lengths, at::full({1}, static_cast<int64_t>(text.size()), at::kLong), group).wait();
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all = at::empty({group.size() * longest}, at::kByte);
  all_gather(all, mine, group).wait();
  std::vector<std::string> texts;
  const auto* bytes = static_cast<const char*>(all.const_data_ptr());
  for (int64_t r = 0; r < group.size(); ++r) {
    texts.emplace_back(bytes + r * longest, lengths[r].item<int64_t>());
  }
  return texts;
}

// Of this rank's tensors kept whole, those it writes: the ones no lower World rank holds.
// Each is written once, by the first rank holding it: rank 0 for a model every rank holds
// alike, a stage's first rank for what only a pipeline stage holds.
std::set<std::string> whole_tensors_written_here(const std::vector<std::string>& names,
                                                 World& world) {
  std::string text;
  for (const auto& name : names) text += name + '\n';
  const std::vector<std::string> texts = all_gather_text(text, *world.world_group());
  std::set<std::string> held_below;
  for (int64_t r = 0; r < world.rank(); ++r) {
    std::istringstream lines(texts[r]);
    for (std::string name; std::getline(lines, name);) held_below.insert(name);
  }
  std::set<std::string> written;
  for (const auto& name : names) {
    if (!held_below.contains(name)) written.insert(name);
  }
  return written;
}

}  // namespace

RankSave rank_save(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                   const StateDict& extra, const std::string& caller) {
  c10::NoGradGuard no_grad;
  const std::vector<ModelParam> params = model_params(model);
  for (const auto& p : params) {
    if (p.shard) require_sharded(*p.shard, p.name, caller.c_str());
  }
  RankSave save{world_of(params, caller), {}};
  const std::vector<std::string> whole = whole_tensor_names(params, model);
  const std::set<std::string> whole_written_here =
      save.world ? whole_tensors_written_here(whole, *save.world)
                 : std::set<std::string>(whole.begin(), whole.end());
  save.pieces = pieces_of_rank(params, model, optimizer, extra, whole_written_here,
                               !save.world || save.world->rank() == 0);
  for (RankPiece& piece : error_feedback_residual_pieces(params)) {
    piece.name = kResidualPrefix + piece.name;
    save.pieces.push_back(std::move(piece));
  }
  return save;
}

std::shared_ptr<World> world_of(const std::vector<ModelParam>& params, const std::string& caller) {
  for (const auto& p : params) {
    if (p.shard) return p.shard->world();
  }
  for (const auto& p : params) {
    if (p.parallel_slice) {
      C10_THROW_ERROR(
          ValueError,
          caller + ": '" + p.name +
              "' is a parallel slice of a model that fully_shard does not manage, so the "
              "ranks cannot agree on the checkpoint; fully_shard the model (a shard size of 1 "
              "is fine) or save a full checkpoint");
    }
  }
  return nullptr;
}

void on_every_rank(const Group* group, const std::string& caller, const std::string& what,
                   const std::function<void()>& step) {
  std::exception_ptr error;
  try {
    step();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  std::vector<int64_t> failed;
  if (group && group->size() > 1) {
    const at::Tensor mine = at::full({1}, error ? 1 : 0, at::kInt);
    at::Tensor all = at::empty({group->size()}, at::kInt);
    all_gather(all, mine, *group).wait();
    for (int64_t r = 0; r < group->size(); ++r) {
      if (all[r].item<int>() != 0) failed.push_back(r);
    }
  }
  if (error) std::rethrow_exception(error);
  if (failed.empty()) return;
  std::string ranks;
  for (int64_t r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  C10_THROW_ERROR(Error,
                  caller + ": " + what + " failed on rank(s) " + ranks + " (their errors say why)");
}

void write_rank_file(const std::string& path, const std::vector<RankPiece>& pieces) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, PieceRecord> records;
  for (const auto& piece : pieces) {
    records[piece.name] = {piece.offsets, piece.whole_shape, crc32_of(piece.tensor)};
    tensors.emplace_back(piece.name, piece.tensor);
  }
  std::map<std::string, std::string> metadata = dcp_metadata(records);
  metadata.emplace(kPiecesMetadataKey, pieces_metadata(records));
  write_safetensors(path, tensors, metadata);
}

std::string staged_rank_file(const std::string& dir, const Group* group) {
  return dir + kStagedSuffix + "/" + rank_file(group ? group->rank() : 0);
}

void write_checkpoint(const std::string& dir,
                      const std::function<void(const std::string&)>& write_this_rank,
                      const Group* group, const std::string& caller) {
  const int64_t rank = group ? group->rank() : 0;
  const int64_t ranks = group ? group->size() : 1;
  const std::string staged = dir + kStagedSuffix;
  try {
    on_every_rank(group, caller, "preparing " + staged, [&] {
      if (rank != 0) return;
      fs::remove_all(staged);  // left by a save that did not complete
      fs::create_directories(staged);
    });
    on_every_rank(group, caller, "writing the ranks' files into " + staged,
                  [&] { write_this_rank(staged_rank_file(dir, group)); });
    on_every_rank(group, caller, "completing " + dir, [&] {
      if (rank != 0) return;
      std::vector<std::string> files;
      for (int64_t r = 0; r < ranks; ++r) files.push_back(rank_file(r));
      const std::string index_crc32 =
          write_index(index_from_files(staged, files), staged + "/" + kIndexFile);
      write_file_durably(staged + "/" + kCompleteMarker, kCompleteRecord + index_crc32 + "\n");
      sync_directory(staged);
      replace_directory(staged, dir);
    });
  } catch (...) {
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(staged, ignored);
    }
    throw;
  }
}

}  // namespace hp::detail

// Sharded checkpoints: each rank writes the pieces it holds into its own safetensors file,
// rank 0 indexes them and commits the directory; loading reads the pieces each rank's
// shards overlap.
#include "hyperparallel/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>

#include "../distributed/error_message.h"
#include "../materialize/model_params.h"
#include "checkpoint_index.h"
#include "durable_files.h"
#include "full_tensor_source.h"
#include "hyperparallel/collectives.h"
#include "safetensors_file.h"
#include "state_io.h"

namespace hp {
namespace {

namespace fs = std::filesystem;

constexpr const char* kIndexFile = "index.json";
constexpr const char* kCompleteMarker = "COMPLETE";
constexpr const char* kModelPrefix = "model/";
constexpr const char* kOptimizerPrefix = "optim/";
constexpr const char* kExtraPrefix = "extra/";

std::string rank_file(int64_t rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

// The World of the model's fully_shard-ed parameters; null when it has none (the calling
// process saves and loads alone).
std::shared_ptr<World> world_of(const std::vector<detail::ModelParam>& params,
                                const std::string& caller) {
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

// Runs `step` on this rank and agrees with the other ranks on the outcome (an all-gather,
// which also makes it a barrier): returns when it succeeded everywhere. Otherwise every
// rank throws: a rank that failed its own error, the others c10::Error naming the
// ranks that failed.
void on_every_rank(const World* world, const std::string& caller, const std::string& what,
                   const std::function<void()>& step) {
  std::exception_ptr error;
  try {
    step();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  std::vector<int64_t> failed;
  if (world && world->size() > 1) {
    const at::Tensor mine = at::full({1}, error ? 1 : 0, at::kInt);
    at::Tensor all = at::empty({world->size()}, at::kInt);
    all_gather(all, mine, *world->world_group()).wait();
    for (int64_t r = 0; r < world->size(); ++r) {
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

// The tensors one rank writes, with what the index needs to know about each.
struct RankPieces {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, detail::PieceRecord> records;

  void add(const std::string& name, const at::Tensor& tensor, std::vector<int64_t> offsets,
           std::vector<int64_t> whole_shape) {
    records[name] = {std::move(offsets), std::move(whole_shape), detail::crc32_of(tensor)};
    tensors.emplace_back(name, tensor.detach());
  }
  // A tensor this rank holds whole.
  void add_whole(const std::string& name, const at::Tensor& tensor) {
    add(name, tensor, std::vector<int64_t>(tensor.dim(), 0), tensor.sizes().vec());
  }
};

// What this rank writes: one copy of every shard (HSDP replicas: replicate rank 0) and
// on rank 0 everything kept whole. Pieces several ranks hold alike (a parameter that is
// not a parallel slice, on every rank of a tensor-parallel group) are indexed once.
RankPieces pieces_of_rank(const std::vector<detail::ModelParam>& params, torch::nn::Module& model,
                          torch::optim::Optimizer* optimizer, const StateDict& extra,
                          bool is_rank0) {
  RankPieces pieces;
  for (const auto& p : params) {
    const std::optional<detail::ParamOptimizerState> state =
        optimizer ? detail::optimizer_state_of(*optimizer, p.variable) : std::nullopt;
    const std::string optim_name = kOptimizerPrefix + p.name + ".";
    // Where this rank's slice starts in the whole tensor (zeros: not a slice).
    std::vector<int64_t> slice_offsets(p.whole_shape.size(), 0);
    if (p.parallel_slice) {
      const Group& group = *p.parallel_slice->group;
      const int64_t dim = p.parallel_slice->dim;
      slice_offsets[dim] = group.rank() * (p.whole_shape[dim] / group.size());
    }
    if (!p.shard) {
      if (!is_rank0 && !p.parallel_slice) continue;
      pieces.add(kModelPrefix + p.name, p.variable, slice_offsets, p.whole_shape);
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
      pieces.add(kModelPrefix + p.name, local, offsets, p.whole_shape);
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
  if (is_rank0) {
    for (const auto& item : model.named_buffers()) {
      pieces.add_whole(kModelPrefix + item.key(), item.value());
    }
    for (const auto& item : extra) pieces.add_whole(kExtraPrefix + item.key(), item.value());
  }
  return pieces;
}

int64_t volume(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

// What the COMPLETE marker says: "index.json crc32 <8 hex digits>".
constexpr const char* kCompleteRecord = "index.json crc32 ";

// The index of the complete checkpoint `dir`, checked against the CRC-32 its COMPLETE
// marker keeps (a marker without one, from a version that wrote none, checks coverage only).
detail::CheckpointIndex verified_index(const std::string& dir) {
  const std::string marker = dir + "/" + kCompleteMarker;
  std::ifstream in(marker);
  std::string record;
  std::getline(in, record);
  std::string crc32;
  if (!record.empty()) {
    if (record.rfind(kCompleteRecord, 0) != 0 ||
        record.size() != std::strlen(kCompleteRecord) + 8) {
      C10_THROW_ERROR(Error,
                      marker + " is damaged (it reads '" + record + "'); load another checkpoint");
    }
    crc32 = record.substr(std::strlen(kCompleteRecord));
  }
  return detail::read_index(dir + "/" + kIndexFile, crc32);
}

// A saved checkpoint, read piece by piece.
class ShardedCheckpointReader {
 public:
  explicit ShardedCheckpointReader(std::string dir)
      : dir_(std::move(dir)), index_(verified_index(dir_)) {}

  // The entries under `prefix`, named without it.
  detail::FullTensorSource source(const std::string& prefix) {
    detail::FullTensorSource source;
    source.description = "sharded checkpoint " + dir_;
    for (const auto& [name, tensor] : index_) {
      if (name.rfind(prefix, 0) == 0) source.names.push_back(name.substr(prefix.size()));
    }
    source.shape_of = [this, prefix](const std::string& name) -> std::optional<c10::IntArrayRef> {
      auto it = index_.find(prefix + name);
      if (it == index_.end()) return std::nullopt;
      return c10::IntArrayRef(it->second.shape);
    };
    source.read = [this, prefix](const std::string& name) { return read_whole(prefix + name); };
    source.read_part = [this, prefix](const std::string& name, int64_t dim, int64_t start,
                                      int64_t length) {
      const detail::IndexedTensor& tensor = index_.at(prefix + name);
      std::vector<int64_t> offsets(tensor.shape.size(), 0);
      std::vector<int64_t> shape = tensor.shape;
      offsets[dim] = start;
      shape[dim] = length;
      return read_box(prefix + name, offsets, shape);
    };
    return source;
  }

  at::Tensor read_whole(const std::string& name) {
    const detail::IndexedTensor& tensor = index_.at(name);
    return read_box(name, std::vector<int64_t>(tensor.shape.size(), 0), tensor.shape);
  }

 private:
  // The part of tensor `name` at `offsets` of `shape`, from the pieces it overlaps (each
  // read whole and checked against its CRC-32).
  at::Tensor read_box(const std::string& name, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& shape) {
    const detail::IndexedTensor& tensor = index_.at(name);
    at::Tensor result = at::empty(shape, at::dtype(tensor.dtype));
    int64_t covered = 0;
    for (const auto& piece : tensor.pieces) {
      std::vector<int64_t> begin(shape.size()), extent(shape.size());
      bool overlaps = true;
      for (size_t d = 0; d < shape.size(); ++d) {
        begin[d] = std::max(offsets[d], piece.offsets[d]);
        const int64_t end = std::min(offsets[d] + shape[d], piece.offsets[d] + piece.shape[d]);
        extent[d] = end - begin[d];
        overlaps = overlaps && extent[d] > 0;
      }
      if (!overlaps) continue;
      const at::Tensor data = read_piece(name, piece);
      at::Tensor from = data;
      at::Tensor to = result;
      for (size_t d = 0; d < shape.size(); ++d) {
        from = from.narrow(static_cast<int64_t>(d), begin[d] - piece.offsets[d], extent[d]);
        to = to.narrow(static_cast<int64_t>(d), begin[d] - offsets[d], extent[d]);
      }
      to.copy_(from);
      covered += volume(extent);
    }
    if (covered != volume(shape)) {
      C10_THROW_ERROR(Error, "tensor '" + name + "' of " + dir_ + "/" + kIndexFile +
                                 ": its pieces do not cover the part requested");
    }
    return result;
  }

  at::Tensor read_piece(const std::string& name, const detail::CheckpointPiece& piece) {
    auto& file = files_[piece.file];
    if (!file) file = std::make_unique<detail::SafetensorsReader>(dir_ + "/" + piece.file);
    const at::Tensor data = file->read(name);
    if (data.sizes() != c10::IntArrayRef(piece.shape)) {
      C10_THROW_ERROR(Error, "tensor '" + name + "' in " + file->path() + " has shape " +
                                 c10::str(data.sizes()) + ", the index says " +
                                 c10::str(c10::IntArrayRef(piece.shape)));
    }
    const std::string crc = detail::crc32_of(data);
    if (crc != piece.crc32) {
      C10_THROW_ERROR(Error, "tensor '" + name + "' in " + file->path() + " is damaged: CRC-32 " +
                                 crc + ", written with " + piece.crc32 +
                                 "; load another checkpoint");
    }
    return data;
  }

  std::string dir_;
  detail::CheckpointIndex index_;
  std::map<std::string, std::unique_ptr<detail::SafetensorsReader>> files_;
};

}  // namespace

void save_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const StateDict& extra) {
  const std::string caller = "save_sharded_checkpoint";
  c10::NoGradGuard no_grad;
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  // Checked before the first collective, so that all ranks throw or none does.
  for (const auto& p : params) {
    if (p.shard) detail::require_sharded(*p.shard, p.name, caller.c_str());
  }
  const std::shared_ptr<World> world = world_of(params, caller);
  const int64_t rank = world ? world->rank() : 0;
  const int64_t ranks = world ? world->size() : 1;
  const std::string staged = dir + ".partial";
  try {
    on_every_rank(world.get(), caller, "preparing " + staged, [&] {
      if (rank != 0) return;
      fs::remove_all(staged);  // left by a save that did not complete
      fs::create_directories(staged);
    });
    on_every_rank(world.get(), caller, "writing the ranks' files into " + staged, [&] {
      const RankPieces pieces = pieces_of_rank(params, model, optimizer, extra, rank == 0);
      detail::write_safetensors(
          staged + "/" + rank_file(rank), pieces.tensors,
          {{detail::kPiecesMetadataKey, detail::pieces_metadata(pieces.records)}});
    });
    on_every_rank(world.get(), caller, "completing " + dir, [&] {
      if (rank != 0) return;
      std::vector<std::string> files;
      for (int64_t r = 0; r < ranks; ++r) files.push_back(rank_file(r));
      const std::string index_crc32 =
          detail::write_index(detail::index_from_files(staged, files), staged + "/" + kIndexFile);
      detail::write_file_durably(staged + "/" + kCompleteMarker,
                                 kCompleteRecord + index_crc32 + "\n");
      detail::sync_directory(staged);
      detail::replace_directory(staged, dir);
    });
  } catch (...) {
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(staged, ignored);
    }
    throw;
  }
}

StateDict load_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                                  torch::optim::Optimizer* optimizer, bool strict) {
  const std::string caller = "load_sharded_checkpoint";
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  StateDict extra;
  on_every_rank(world_of(params, caller).get(), caller, "loading " + dir, [&] {
    if (!is_complete_checkpoint(dir)) {
      C10_THROW_ERROR(
          ValueError,
          caller + ": " + dir + " is not a complete sharded checkpoint (no " + kCompleteMarker +
              " marker: a save that did not finish, or not a checkpoint); load an earlier one");
    }
    ShardedCheckpointReader reader(dir);
    detail::load_model_state(model, reader.source(kModelPrefix), strict, caller);
    if (optimizer) {
      detail::load_optimizer_state(model, *optimizer, reader.source(kOptimizerPrefix), strict,
                                   caller);
    }
    const detail::FullTensorSource extras = reader.source(kExtraPrefix);
    for (const auto& name : extras.names) extra.insert(name, extras.read(name));
  });
  return extra;
}

bool is_complete_checkpoint(const std::string& dir) {
  std::error_code ignored;
  return fs::is_regular_file(fs::path(dir) / kCompleteMarker, ignored);
}

std::optional<std::string> latest_checkpoint(const std::string& root,
                                             std::vector<std::string>* skipped) {
  std::error_code error;
  fs::directory_iterator entries(root, error);
  if (error) return std::nullopt;
  static const std::regex step_name("step-([0-9]+)");
  std::map<int64_t, std::string, std::greater<>> complete;  // newest first
  for (const auto& entry : entries) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, match, step_name) && is_complete_checkpoint(entry.path())) {
      complete.emplace(std::stoll(match[1]), entry.path().string());
    }
  }
  for (const auto& [step, dir] : complete) {
    try {
      verified_index(dir);
      return dir;
    } catch (const std::exception& damage) {
      if (skipped) skipped->push_back(detail::message_of(damage));
    }
  }
  return std::nullopt;
}

std::string checkpoint_dir_for_step(const std::string& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return (fs::path(root) / name).string();
}

}  // namespace hp

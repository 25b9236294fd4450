// Sharded checkpoints: each rank writes the pieces it holds into its own safetensors file,
// rank 0 indexes them and commits the directory; loading reads the pieces each rank's
// shards overlap.
#include "hyperparallel/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

#include "../distributed/error_message.h"
#include "../materialize/model_params.h"
#include "checkpoint_index.h"
#include "checkpoint_writing.h"
#include "error_feedback_residuals.h"
#include "full_tensor_source.h"
#include "hyperparallel/collectives.h"
#include "safetensors_file.h"
#include "state_io.h"
#include "torch_save_writer.h"

namespace hp {
namespace {

namespace fs = std::filesystem;

// Model tensors are named by their fully qualified names alone, as PyTorch names them, so
// that torch.distributed.checkpoint loads them into a model's state_dict(); checkpoints of
// earlier versions named them "model/<name>".
constexpr const char* kEarlierModelPrefix = "model/";
// What PyTorch's HuggingFaceStorageWriter may write besides the tensors' files.
constexpr const char* kSafetensorsSuffix = ".safetensors";
constexpr const char* kDcpWeightMap = "model.safetensors.index.json";

int64_t volume(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

// The index of the complete checkpoint `dir`, checked against the CRC-32 its COMPLETE
// marker keeps (a marker without one, from a version that wrote none, checks coverage only).
detail::CheckpointIndex verified_index(const std::string& dir) {
  const std::string marker = dir + "/" + detail::kCompleteMarker;
  std::ifstream in(marker);
  std::string record;
  std::getline(in, record);
  std::string crc32;
  if (!record.empty()) {
    if (record.rfind(detail::kCompleteRecord, 0) != 0 ||
        record.size() != std::strlen(detail::kCompleteRecord) + 8) {
      C10_THROW_ERROR(Error,
                      marker + " is damaged (it reads '" + record + "'); load another checkpoint");
    }
    crc32 = record.substr(std::strlen(detail::kCompleteRecord));
  }
  return detail::read_index(dir + "/" + detail::kIndexFile, crc32);
}

// The safetensors files directly in `dir`, sorted.
std::vector<std::string> safetensors_files(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.ends_with(kSafetensorsSuffix)) files.push_back(name);
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Where a consolidated directory's weight map (`path`) puts each tensor, every file it
// names checked present among `files`.
std::map<std::string, std::string> read_weight_map(const fs::path& path,
                                                   const std::vector<std::string>& files,
                                                   const std::string& caller) {
  std::ifstream in(path);
  std::map<std::string, std::string> file_of;
  try {
    const nlohmann::json root = nlohmann::json::parse(in);
    for (const auto& [name, file] : root.at("weight_map").items()) {
      file_of.emplace(name, file.get<std::string>());
    }
  } catch (const nlohmann::json::exception& error) {
    C10_THROW_ERROR(ValueError, caller + ": " + path.string() + " is malformed: " + error.what());
  }
  for (const auto& [name, file] : file_of) {
    if (!std::binary_search(files.begin(), files.end(), file)) {
      C10_THROW_ERROR(ValueError, caller + ": " + path.string() + " puts '" + name + "' in " +
                                      file + ", which is missing (a save that did not finish?)");
    }
  }
  return file_of;
}

// The index of a directory PyTorch's Distributed Checkpoint wrote with
// HuggingFaceStorageWriter: sharded files (each piece's offsets in DCP_SHARDING_INFO) or
// consolidated ones (whole tensors, listed in model.safetensors.index.json). DCP writes no
// completion marker nor checksums: the pieces must cover every tensor, each exactly once;
// a consolidated directory is read from the files its weight map names alone (others may
// be left from an earlier save), each holding what the map says.
detail::CheckpointIndex index_of_pytorch_checkpoint(const std::string& dir,
                                                    const std::string& caller) {
  const std::vector<std::string> files = safetensors_files(dir);
  for (const auto& file : files) {
    if (detail::SafetensorsReader(dir + "/" + file)
            .metadata()
            .contains(detail::kPiecesMetadataKey)) {
      C10_THROW_ERROR(ValueError, caller + ": " + dir +
                                      " is not a complete sharded checkpoint (no " +
                                      detail::kCompleteMarker +
                                      " marker: a save that did not finish); load an earlier one");
    }
  }
  if (files.empty()) {
    C10_THROW_ERROR(ValueError, caller + ": " + dir + " is neither a sharded checkpoint (no " +
                                    detail::kCompleteMarker +
                                    " marker) nor a directory of safetensors files that PyTorch's "
                                    "Distributed Checkpoint wrote; pass a checkpoint directory");
  }
  const fs::path weight_map = fs::path(dir) / kDcpWeightMap;
  if (!fs::exists(weight_map)) return detail::index_from_files(dir, files);
  const std::map<std::string, std::string> file_of = read_weight_map(weight_map, files, caller);
  std::set<std::string> named;
  for (const auto& [name, file] : file_of) named.insert(file);
  detail::CheckpointIndex index =
      detail::index_from_files(dir, std::vector<std::string>(named.begin(), named.end()));
  for (const auto& [name, tensor] : index) {
    const auto it = file_of.find(name);
    for (const auto& piece : tensor.pieces) {
      if (it == file_of.end() || it->second != piece.file) {
        C10_THROW_ERROR(ValueError,
                        caller + ": " + dir + "/" + piece.file + " holds tensor '" + name +
                            "', which " + weight_map.string() +
                            (it == file_of.end() ? " does not list" : " puts in " + it->second) +
                            "; the directory mixes two saves");
      }
    }
  }
  for (const auto& [name, file] : file_of) {
    if (!index.contains(name)) {
      C10_THROW_ERROR(ValueError, caller + ": " + weight_map.string() + " puts '" + name + "' in " +
                                      file + ", which does not hold it");
    }
  }
  return index;
}

// A saved checkpoint, read piece by piece: one of ours (COMPLETE), or one PyTorch wrote.
class ShardedCheckpointReader {
 public:
  ShardedCheckpointReader(std::string dir, const std::string& caller)
      : dir_(std::move(dir)),
        index_(is_complete_checkpoint(dir_) ? verified_index(dir_)
                                            : index_of_pytorch_checkpoint(dir_, caller)) {}

  // The model's parameters and buffers: the entries that are neither optimizer state,
  // extras nor residuals (in a checkpoint of an earlier version, those under "model/").
  detail::FullTensorSource model_source() {
    const bool earlier = std::any_of(index_.begin(), index_.end(), [](const auto& entry) {
      return entry.first.starts_with(kEarlierModelPrefix);
    });
    return source(earlier ? kEarlierModelPrefix : "", [earlier](const std::string& name) {
      return earlier ||
             !(name.starts_with(detail::kOptimizerPrefix) ||
               name.starts_with(detail::kExtraPrefix) || name.starts_with(detail::kResidualPrefix));
    });
  }

  // The entries under `prefix` (that `include` accepts), named without it.
  detail::FullTensorSource source(
      const std::string& prefix, const std::function<bool(const std::string&)>& include =
                                     [](const std::string&) { return true; }) {
    detail::FullTensorSource source;
    source.description = "sharded checkpoint " + dir_;
    for (const auto& [name, tensor] : index_) {
      if (name.starts_with(prefix) && include(name)) {
        source.names.push_back(name.substr(prefix.size()));
      }
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
      C10_THROW_ERROR(Error, "tensor '" + name + "' of " + dir_ + "/" + detail::kIndexFile +
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
    if (!piece.crc32.empty() && crc != piece.crc32) {
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

// Throws c10::Error when a file `index` names is missing or does not hold its pieces as
// indexed within its size (a truncated file's header places them past its end); reads
// the files' headers only.
void check_files(const std::string& dir, const detail::CheckpointIndex& index) {
  std::map<std::string, std::vector<std::pair<std::string, const detail::CheckpointPiece*>>>
      by_file;
  for (const auto& [name, tensor] : index) {
    for (const auto& piece : tensor.pieces) by_file[piece.file].emplace_back(name, &piece);
  }
  for (const auto& [file, pieces] : by_file) {
    const std::string path = dir + "/" + file;
    std::unique_ptr<detail::SafetensorsReader> reader;
    try {
      reader = std::make_unique<detail::SafetensorsReader>(path);
    } catch (const c10::Error& error) {
      C10_THROW_ERROR(Error, dir + " is damaged: " + error.what_without_backtrace());
    }
    for (const auto& [name, piece] : pieces) {
      const auto entry = reader->entries().find(name);
      if (entry == reader->entries().end() || entry->second.shape != piece->shape) {
        C10_THROW_ERROR(Error, dir + " is damaged: " + path + " does not hold tensor '" + name +
                                   "' as its index says");
      }
    }
  }
}

// Adds to `used` the entries of `source` that other ranks of `group` use: strict loading
// asks that every entry be used by some rank, since each pipeline stage loads only its
// own layers. The index, hence the order of `source.names`, is the same on every rank.
void add_entries_used_elsewhere(const detail::FullTensorSource& source, std::set<std::string>& used,
                                const Group* group) {
  if (!group || group->size() == 1 || source.names.empty()) return;
  const auto entries = static_cast<int64_t>(source.names.size());
  at::Tensor marks = at::zeros({entries}, at::kInt);
  int* mark = marks.data_ptr<int>();
  for (int64_t i = 0; i < entries; ++i) mark[i] = used.count(source.names[i]) ? 1 : 0;
  all_reduce(marks, ReduceOp::kMax, *group).wait();
  for (int64_t i = 0; i < entries; ++i) {
    if (mark[i] != 0) used.insert(source.names[i]);
  }
}

}  // namespace

void save_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const StateDict& extra) {
  const std::string caller = "save_sharded_checkpoint";
  const detail::RankSave save = detail::rank_save(model, optimizer, extra, caller);
  detail::write_checkpoint(
      dir, [&](const std::string& path) { detail::write_rank_file(path, save.pieces); },
      save.world ? save.world->world_group().get() : nullptr, caller);
}

StateDict load_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                                  torch::optim::Optimizer* optimizer, bool strict) {
  const std::string caller = "load_sharded_checkpoint";
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  const std::shared_ptr<World> world = detail::world_of(params, caller);
  const Group* group = world ? world->world_group().get() : nullptr;
  std::optional<ShardedCheckpointReader> reader;
  detail::FullTensorSource model_source, optimizer_source, residual_source;
  std::set<std::string> model_used, optimizer_used, residual_used;
  detail::on_every_rank(group, caller, "checking " + dir + " against the model", [&] {
    reader.emplace(dir, caller);
    model_source = reader->model_source();
    model_used = detail::model_entries(model, model_source, caller);
    if (optimizer) {
      optimizer_source = reader->source(detail::kOptimizerPrefix);
      optimizer_used = detail::optimizer_entries(model, *optimizer, optimizer_source, caller);
    }
    residual_source = reader->source(detail::kResidualPrefix);
    residual_used = detail::error_feedback_residual_entries(params, residual_source);
  });
  // Every rank reached here: the unions are taken on all of them, and all agree.
  add_entries_used_elsewhere(residual_source, residual_used, group);
  if (strict) {
    add_entries_used_elsewhere(model_source, model_used, group);
    add_entries_used_elsewhere(optimizer_source, optimizer_used, group);
    const std::string anywhere = group && group->size() > 1 ? " on any rank" : "";
    detail::require_all_used(model_source, model_used, strict, caller,
                             "not a parameter or buffer of the model" + anywhere);
    detail::require_all_used(optimizer_source, optimizer_used, strict, caller,
                             "no state of this optimizer for a parameter of the model" + anywhere);
  }
  StateDict extra;
  detail::on_every_rank(group, caller, "loading " + dir, [&] {
    detail::load_model_state(model, model_source, /*strict=*/false, caller);
    if (optimizer) {
      detail::load_optimizer_state(model, *optimizer, optimizer_source, /*strict=*/false, caller);
    }
    detail::load_error_feedback_residuals(params, residual_source, caller);
    detail::warn_unused_error_feedback_residuals(residual_source, residual_used, caller);
    const detail::FullTensorSource extras = reader->source(detail::kExtraPrefix);
    for (const auto& name : extras.names) extra.insert(name, extras.read(name));
  });
  return extra;
}

void convert_to_full_checkpoint(const std::string& dir, const std::string& model_path,
                                const std::string& optimizer_path) {
  const std::string caller = "convert_to_full_checkpoint";
  if (!optimizer_path.empty() &&
      fs::path(model_path).lexically_normal() == fs::path(optimizer_path).lexically_normal()) {
    C10_THROW_ERROR(ValueError, caller + ": the model and the optimizer state would both go to " +
                                    model_path + "; give them two files");
  }
  ShardedCheckpointReader reader(dir, caller);
  const detail::FullTensorSource optimizer_source = reader.source(detail::kOptimizerPrefix);
  if (!optimizer_path.empty() && optimizer_source.names.empty()) {
    C10_THROW_ERROR(ValueError, caller + ": " + dir +
                                    " holds no optimizer state; pass no optimizer path to "
                                    "write the model alone");
  }
  const auto write = [](const detail::FullTensorSource& source, const std::string& path) {
    detail::TorchSaveWriter writer(path);
    for (const auto& name : source.names) writer.write(name, source.read(name));
    writer.finish();
  };
  write(reader.model_source(), model_path);
  if (!optimizer_path.empty()) write(optimizer_source, optimizer_path);
}

bool is_complete_checkpoint(const std::string& dir) {
  std::error_code ignored;
  return fs::is_regular_file(fs::path(dir) / detail::kCompleteMarker, ignored);
}

std::optional<std::string> latest_checkpoint(const std::string& root,
                                             std::vector<std::string>* skipped, bool check_data) {
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
      const detail::CheckpointIndex index = verified_index(dir);
      check_files(dir, index);
      if (check_data) {
        ShardedCheckpointReader reader(dir, "latest_checkpoint");
        for (const auto& [name, tensor] : index) reader.read_whole(name);
      }
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

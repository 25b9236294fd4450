#include "checkpoint_index.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "durable_files.h"
#include "safetensors_file.h"

namespace hp::detail {
namespace {

using nlohmann::json;

constexpr const char* kFormat = "hyperparallel sharded checkpoint";
constexpr int kVersion = 1;

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

// Whether two pieces share an element.
bool overlap(const CheckpointPiece& a, const CheckpointPiece& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.shape[d] || b.offsets[d] >= a.offsets[d] + a.shape[d]) {
      return false;
    }
  }
  return true;
}

// Whether `piece` is a part `tensor` has already (ranks that hold the same values write
// the same piece: the first file's is kept). Throws when the copies differ, and when
// neither copy has a CRC to compare (files PyTorch wrote: it writes each piece once, so
// a second copy is a file left from another save, and nothing tells which is current).
bool is_copy_of_indexed(const std::string& dir, const std::string& name,
                        const IndexedTensor& tensor, const CheckpointPiece& piece) {
  for (const auto& indexed : tensor.pieces) {
    if (indexed.offsets != piece.offsets || indexed.shape != piece.shape) continue;
    if (indexed.crc32.empty() && piece.crc32.empty()) {
      C10_THROW_ERROR(ValueError, dir + ": tensor '" + name + "': " + indexed.file + " and " +
                                      piece.file +
                                      " both hold the same part and neither has a checksum "
                                      "(a file left from another save?); remove the stale file");
    }
    if (!indexed.crc32.empty() && !piece.crc32.empty() && indexed.crc32 != piece.crc32) {
      C10_THROW_ERROR(Error, "tensor '" + name + "': " + indexed.file + " and " + piece.file +
                                 " hold the same part with different values (replicas that "
                                 "diverged)");
    }
    return true;
  }
  return false;
}

void check_covers(const std::string& name, const IndexedTensor& tensor) {
  int64_t covered = 0;
  for (size_t i = 0; i < tensor.pieces.size(); ++i) {
    const CheckpointPiece& piece = tensor.pieces[i];
    for (size_t d = 0; d < tensor.shape.size(); ++d) {
      if (piece.offsets[d] < 0 || piece.offsets[d] + piece.shape[d] > tensor.shape[d]) {
        C10_THROW_ERROR(Error, "tensor '" + name + "': the piece in " + piece.file +
                                   " lies outside its whole shape");
      }
    }
    for (size_t j = 0; j < i; ++j) {
      if (overlap(piece, tensor.pieces[j])) {
        C10_THROW_ERROR(Error, "tensor '" + name + "': the pieces in " + piece.file + " and " +
                                   tensor.pieces[j].file + " overlap");
      }
    }
    covered += volume(piece.shape);
  }
  if (covered != volume(tensor.shape)) {
    C10_THROW_ERROR(Error, "tensor '" + name + "': its pieces cover " + std::to_string(covered) +
                               " of its " + std::to_string(volume(tensor.shape)) + " elements");
  }
}

// What a file says of one of its tensors besides dtype and shape.
struct FileRecord {
  std::vector<int64_t> offsets;
  std::optional<std::vector<int64_t>> whole_shape;  // unset: not said
  std::string crc32;                                // empty: not said
};

// This library's piece records; else PyTorch's DCP_SHARDING_INFO offsets; else (a file of
// whole tensors, as DCP consolidates them) zeros.
std::map<std::string, FileRecord> records_of(const SafetensorsReader& reader) {
  const auto& metadata = reader.metadata();
  const auto ours = metadata.find(kPiecesMetadataKey);
  const auto dcp = metadata.find(kDcpShardingInfoKey);
  const json said_by_file = ours != metadata.end()  ? json::parse(ours->second)
                            : dcp != metadata.end() ? json::parse(dcp->second)
                                                    : json::object();
  std::map<std::string, FileRecord> records;
  for (const auto& [name, entry] : reader.entries()) {
    FileRecord& record = records[name];
    if (ours != metadata.end()) {
      const json& said = said_by_file.at(name);
      record.offsets = said.at("offsets").get<std::vector<int64_t>>();
      record.whole_shape = said.at("whole_shape").get<std::vector<int64_t>>();
      record.crc32 = said.at("crc32").get<std::string>();
    } else if (dcp != metadata.end()) {
      record.offsets = said_by_file.at(name).at("saved_offsets").get<std::vector<int64_t>>();
    } else {
      record.offsets.assign(entry.shape.size(), 0);
    }
    if (record.offsets.size() != entry.shape.size()) {
      C10_THROW_ERROR(Error, reader.path() + ": the offsets of tensor '" + name +
                                 "' have another number of dimensions than its shape");
    }
  }
  return records;
}

}  // namespace

std::string pieces_metadata(const std::map<std::string, PieceRecord>& pieces) {
  json records = json::object();
  for (const auto& [name, record] : pieces) {
    records[name] = {
        {"offsets", record.offsets}, {"whole_shape", record.whole_shape}, {"crc32", record.crc32}};
  }
  return records.dump();
}

std::map<std::string, std::string> dcp_metadata(const std::map<std::string, PieceRecord>& pieces) {
  json offsets = json::object();
  for (const auto& [name, record] : pieces) offsets[name] = {{"saved_offsets", record.offsets}};
  return {{kDcpShardingInfoKey, offsets.dump()}, {"DCP_VERSION", "1.0"}, {"format", "pt"}};
}

CheckpointIndex index_from_files(const std::string& dir, const std::vector<std::string>& files) {
  CheckpointIndex index;
  std::set<std::string> shape_from_pieces;  // tensors whose files do not say their whole shape
  for (const auto& file : files) {
    const SafetensorsReader reader(dir + "/" + file);
    try {
      for (auto& [name, record] : records_of(reader)) {
        const SafetensorsReader::Entry& entry = reader.entries().at(name);
        const bool inferred = !record.whole_shape;
        auto [found, inserted] = index.try_emplace(
            name,
            IndexedTensor{entry.dtype, record.whole_shape.value_or(std::vector<int64_t>{}), {}});
        if (inserted && inferred) shape_from_pieces.insert(name);
        if (found->second.dtype != entry.dtype || inferred != shape_from_pieces.contains(name) ||
            (!inferred && found->second.shape != *record.whole_shape)) {
          C10_THROW_ERROR(Error, "tensor '" + name + "' has another dtype or whole shape in " +
                                     file + " than in the files before");
        }
        CheckpointPiece piece{file, std::move(record.offsets), entry.shape,
                              std::move(record.crc32)};
        if (!is_copy_of_indexed(dir, name, found->second, piece)) {
          found->second.pieces.push_back(std::move(piece));
        }
      }
    } catch (const json::exception& error) {
      C10_THROW_ERROR(Error,
                      reader.path() + ": its piece records are malformed (" + error.what() + ")");
    }
  }
  for (const auto& name : shape_from_pieces) {
    IndexedTensor& tensor = index.at(name);
    tensor.shape.assign(tensor.pieces.front().shape.size(), 0);
    for (const auto& piece : tensor.pieces) {
      for (size_t d = 0; d < tensor.shape.size(); ++d) {
        tensor.shape[d] = std::max(tensor.shape[d], piece.offsets[d] + piece.shape[d]);
      }
    }
  }
  for (const auto& [name, tensor] : index) check_covers(name, tensor);
  return index;
}

std::string write_index(const CheckpointIndex& index, const std::string& path) {
  json tensors = json::object();
  for (const auto& [name, tensor] : index) {
    json pieces = json::array();
    for (const auto& piece : tensor.pieces) {
      pieces.push_back({{"file", piece.file},
                        {"offsets", piece.offsets},
                        {"shape", piece.shape},
                        {"crc32", piece.crc32}});
    }
    tensors[name] = {{"dtype", safetensors_dtype_name(tensor.dtype)},
                     {"shape", tensor.shape},
                     {"pieces", std::move(pieces)}};
  }
  const std::string text =
      json{{"format", kFormat}, {"version", kVersion}, {"tensors", std::move(tensors)}}.dump(1) +
      "\n";
  write_file_durably(path, text);
  return crc32_of(text);
}

CheckpointIndex read_index(const std::string& path, const std::string& crc32) {
  std::ifstream in(path, std::ios::binary);
  if (!in) C10_THROW_ERROR(ValueError, "cannot open " + path + ": " + std::strerror(errno));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (!crc32.empty() && crc32_of(text) != crc32) {
    C10_THROW_ERROR(Error, path + " is damaged: CRC-32 " + crc32_of(text) + ", written with " +
                               crc32 + "; load another checkpoint");
  }
  CheckpointIndex index;
  try {
    const json root = json::parse(text);
    if (root.at("format") != kFormat || root.at("version") != kVersion) {
      C10_THROW_ERROR(ValueError, path + " is not a version " + std::to_string(kVersion) +
                                      " index of a hyperparallel sharded checkpoint");
    }
    for (const auto& [name, tensor] : root.at("tensors").items()) {
      const std::optional<c10::ScalarType> dtype =
          safetensors_dtype(tensor.at("dtype").get<std::string>());
      if (!dtype)
        C10_THROW_ERROR(ValueError, path + ": tensor '" + name + "' has an unknown dtype");
      IndexedTensor entry{*dtype, tensor.at("shape").get<std::vector<int64_t>>(), {}};
      for (const auto& piece : tensor.at("pieces")) {
        entry.pieces.push_back(
            {piece.at("file").get<std::string>(), piece.at("offsets").get<std::vector<int64_t>>(),
             piece.at("shape").get<std::vector<int64_t>>(), piece.at("crc32").get<std::string>()});
        if (entry.pieces.back().offsets.size() != entry.shape.size() ||
            entry.pieces.back().shape.size() != entry.shape.size()) {
          C10_THROW_ERROR(ValueError, path + ": tensor '" + name +
                                          "' has a piece of another rank than the tensor");
        }
      }
      index.emplace(name, std::move(entry));
    }
  } catch (const json::exception& error) {
    C10_THROW_ERROR(ValueError, path + " is malformed: " + error.what());
  }
  for (const auto& [name, tensor] : index) {
    try {
      check_covers(name, tensor);
    } catch (const c10::Error& error) {
      C10_THROW_ERROR(Error, path + " is damaged: " + error.what_without_backtrace() +
                                 "; load another checkpoint");
    }
  }
  return index;
}

}  // namespace hp::detail

#pragma once
// index.json of a sharded checkpoint: for every tensor its dtype, whole shape and the
// pieces that cover it. Rank 0 builds it from the headers of the ranks' files after they
// are written; every rank reads it to find the pieces it needs. A directory of safetensors
// files that PyTorch's Distributed Checkpoint wrote (HuggingFaceStorageWriter) is indexed
// from its files' headers alone.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hp::detail {

// A part of a whole tensor, stored in one file under the tensor's name.
struct CheckpointPiece {
  std::string file;              // relative to the checkpoint directory
  std::vector<int64_t> offsets;  // where it starts in the whole tensor, per dimension
  std::vector<int64_t> shape;
  std::string crc32;  // of its bytes, 8 hex digits; empty: not known (files PyTorch wrote)
};

struct IndexedTensor {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;  // of the whole tensor
  std::vector<CheckpointPiece> pieces;
};

using CheckpointIndex = std::map<std::string, IndexedTensor>;

// A checkpoint directory holds index.json and, written last, the COMPLETE marker, which
// says "index.json crc32 <8 hex digits>".
inline constexpr const char* kIndexFile = "index.json";
inline constexpr const char* kCompleteMarker = "COMPLETE";
inline constexpr const char* kCompleteRecord = "index.json crc32 ";

// Tensors are named by the model's fully qualified names, and these prefixes for the
// optimizer's state, the program's extras and the error-feedback residuals.
inline constexpr const char* kOptimizerPrefix = "optim/";
inline constexpr const char* kExtraPrefix = "extra/";
inline constexpr const char* kResidualPrefix = "error_feedback/";

// What a rank's file says about each piece besides dtype and shape (the safetensors
// header's "__metadata__" entry of this name, a JSON object by tensor name).
inline constexpr const char* kPiecesMetadataKey = "hyperparallel.pieces";

// The "__metadata__" value describing `pieces` (tensor name -> offsets, whole shape, CRC).
struct PieceRecord {
  std::vector<int64_t> offsets;
  std::vector<int64_t> whole_shape;
  std::string crc32;
};
std::string pieces_metadata(const std::map<std::string, PieceRecord>& pieces);

// The "__metadata__" entries that make a file readable by PyTorch's Distributed Checkpoint
// (torch.distributed.checkpoint.HuggingFaceStorageReader): where each piece starts in its
// whole tensor, as HuggingFaceStorageWriter records it.
inline constexpr const char* kDcpShardingInfoKey = "DCP_SHARDING_INFO";
std::map<std::string, std::string> dcp_metadata(const std::map<std::string, PieceRecord>& pieces);

// Reads the headers of `files` (in `dir`) and checks that the pieces of every tensor
// cover it exactly once. A file without this library's piece records is read as PyTorch
// writes them: offsets from DCP_SHARDING_INFO (none: whole tensors), whole shapes from the
// pieces' extents, no CRC. Throws c10::Error naming the file or tensor otherwise.
CheckpointIndex index_from_files(const std::string& dir, const std::vector<std::string>& files);

// index.json, written (and flushed to the disk); returns the CRC-32 of its bytes, which
// the checkpoint's COMPLETE marker keeps.
std::string write_index(const CheckpointIndex& index, const std::string& path);

// Reads index.json, checks its bytes against `crc32` (unless empty) and that the pieces
// of every tensor cover it exactly once, as at the save: a damaged index is never used.
// Throws c10::ValueError naming the file when it is missing or malformed, and
// c10::Error when it is damaged.
CheckpointIndex read_index(const std::string& path, const std::string& crc32);

}  // namespace hp::detail

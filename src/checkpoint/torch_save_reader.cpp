#include "torch_save_reader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <zip.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace hp::detail {
namespace {

// While the dict is unpickled, each storage holds the key of its record instead of data,
// so that no tensor data is loaded.
struct RecordKey {
  std::string key;
};

void delete_record_key(void* context) { delete static_cast<RecordKey*>(context); }

at::DataPtr record_key_placeholder(const std::string& key) {
  return at::DataPtr(nullptr, new RecordKey{key}, &delete_record_key, at::kCPU);
}

constexpr const char* kHostByteOrder = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? "little" : "big";

// Elements of the storage the view reaches; 0 for an empty view.
int64_t storage_elements_needed(const TorchSaveReader::Entry& entry) {
  int64_t last = entry.storage_offset;
  for (size_t d = 0; d < entry.shape.size(); ++d) {
    if (entry.shape[d] == 0) return 0;
    last += (entry.shape[d] - 1) * entry.strides[d];
  }
  return last + 1;
}

// The CRC-32 the zip archive at `path` stores for each record, by its name inside the
// archive's top directory ("data/0", ...).
std::unordered_map<std::string, uint32_t> stored_crcs(const std::string& path) {
  int error = 0;
  zip_t* archive = zip_open(path.c_str(), ZIP_RDONLY, &error);
  if (archive == nullptr) {
    zip_error_t reason;
    zip_error_init_with_code(&reason, error);
    const std::string text = zip_error_strerror(&reason);
    zip_error_fini(&reason);
    C10_THROW_ERROR(ValueError, path + " is not a readable zip archive: " + text);
  }
  std::unordered_map<std::string, uint32_t> crcs;
  const zip_int64_t count = zip_get_num_entries(archive, 0);
  for (zip_int64_t i = 0; i < count; ++i) {
    zip_stat_t stat;
    if (zip_stat_index(archive, static_cast<zip_uint64_t>(i), 0, &stat) != 0 ||
        !(stat.valid & ZIP_STAT_NAME) || !(stat.valid & ZIP_STAT_CRC)) {
      continue;
    }
    const std::string name = stat.name;
    const size_t slash = name.find('/');
    if (slash != std::string::npos) crcs[name.substr(slash + 1)] = stat.crc;
  }
  zip_discard(archive);
  return crcs;
}

// Whether `size` bytes at `data` match the CRC-32 the zip stores for `record`. LibTorch's
// reader checks none, and a damaged central directory points it at other bytes.
bool crc_matches(const std::unordered_map<std::string, uint32_t>& crcs, const std::string& record,
                 const void* data, size_t size) {
  const auto stored = crcs.find(record);
  return stored != crcs.end() &&
         stored->second == static_cast<uint32_t>(crc32_z(crc32_z(0, nullptr, 0),
                                                         static_cast<const Bytef*>(data), size));
}

}  // namespace

TorchSaveReader::TorchSaveReader(const std::string& path) : path_(path) {
  // PyTorchStreamReader would report a missing file only as an errno number.
  if (std::FILE* file = std::fopen(path.c_str(), "rb")) {
    std::fclose(file);
  } else {
    C10_THROW_ERROR(ValueError,
                    "cannot open checkpoint file " + path + ": " + std::strerror(errno));
  }
  try {
    archive_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(ValueError,
                    path +
                        " is not a torch.save zip archive (truncated, damaged, or saved "
                        "with _use_new_zipfile_serialization=False?): " +
                        error.what_without_backtrace());
  }
  record_crcs_ = stored_crcs(path);
  const auto checked_record = [&](const std::string& record) {
    auto [data, size] = archive_->getRecord(record);
    if (!crc_matches(record_crcs_, record, data.get(), size)) {
      C10_THROW_ERROR(ValueError, path + ": its record '" + record +
                                      "' fails the CRC-32 check (the file is damaged)");
    }
    return std::make_pair(std::move(data), size);
  };
  if (archive_->hasRecord("byteorder")) {
    auto [order, size] = checked_record("byteorder");
    if (std::string(static_cast<const char*>(order.get()), size) != kHostByteOrder) {
      C10_THROW_ERROR(ValueError, path + " holds tensors in another byte order than this " +
                                      "machine's; load and save it again with Python's torch here");
    }
  }
  if (!archive_->hasRecord("data.pkl")) {
    C10_THROW_ERROR(ValueError, path +
                                    " has no data.pkl: not written by torch.save (a TorchScript "
                                    "module?); save a dict of tensors");
  }
  auto [pickle, pickle_size] = checked_record("data.pkl");
  size_t pickle_read = 0;
  auto read_pickle = [&, data = static_cast<const char*>(pickle.get())](char* buffer, size_t n) {
    n = std::min(n, pickle_size - pickle_read);
    std::memcpy(buffer, data + pickle_read, n);
    pickle_read += n;
    return n;
  };
  c10::IValue value;
  try {
    torch::jit::Unpickler unpickler(read_pickle, /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
                                    &record_key_placeholder, at::Device(at::kCPU));
    unpickler.set_version(archive_->version());
    value = unpickler.parse_ivalue();
  } catch (const c10::Error& error) {
    // LibTorch's unpickler reads Python's OrderedDict (what state_dict() returns) as None.
    C10_THROW_ERROR(ValueError, path + ": cannot unpickle its dict (" +
                                    error.what_without_backtrace() +
                                    "); save a plain dict of tensors (in Python: "
                                    "torch.save(dict(model.state_dict()), path))");
  }
  if (!value.isGenericDict()) {
    C10_THROW_ERROR(ValueError, path + " does not hold a dict of tensors (a state dict)");
  }
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      C10_THROW_ERROR(ValueError, path + " holds a dict entry that is not name -> tensor");
    }
    const std::string& name = item.key().toStringRef();
    const at::Tensor& tensor = item.value().toTensor();
    if (tensor.layout() != at::kStrided || tensor.is_quantized()) {
      C10_THROW_ERROR(ValueError,
                      "'" + name + "' in " + path +
                          " is a sparse or quantized tensor; only dense tensors are read");
    }
    Entry entry{name,
                tensor.scalar_type(),
                tensor.sizes().vec(),
                tensor.strides().vec(),
                tensor.storage_offset(),
                static_cast<int64_t>(tensor.storage().nbytes()),
                ""};
    if (auto* key = tensor.storage().data_ptr().cast_context<RecordKey>(&delete_record_key)) {
      entry.record = "data/" + key->key;
    }
    // Checked now, so that a damaged file is refused before anything is loaded from it.
    const int64_t needed = storage_elements_needed(entry) * tensor.element_size();
    const bool has_record = !entry.record.empty() && archive_->hasRecord(entry.record);
    if (needed > entry.storage_bytes || (entry.storage_bytes > 0 && !has_record) ||
        (has_record &&
         archive_->getRecordSize(entry.record) != static_cast<size_t>(entry.storage_bytes))) {
      C10_THROW_ERROR(ValueError, "'" + name + "' in " + path +
                                      ": its data record is missing or of another size than its "
                                      "shape needs (a damaged file)");
    }
    index_[name] = entries_.size();
    entries_.push_back(std::move(entry));
  }
}

TorchSaveReader::~TorchSaveReader() = default;

const TorchSaveReader::Entry* TorchSaveReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

at::Tensor TorchSaveReader::read(const Entry& entry) {
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(entry.dtype));
  at::Tensor storage = at::empty({entry.storage_bytes / itemsize}, at::dtype(entry.dtype));
  if (entry.storage_bytes > 0) {
    try {
      archive_->getRecord(entry.record, storage.data_ptr(), entry.storage_bytes);
    } catch (const c10::Error& error) {
      C10_THROW_ERROR(Error, "cannot read '" + entry.name + "' from " + path_ + " (record " +
                                 entry.record + "): " + error.what_without_backtrace());
    }
    // LibTorch's reader does not check the archive's CRCs: damaged bytes would load.
    if (!crc_matches(record_crcs_, entry.record, storage.data_ptr(),
                     static_cast<size_t>(entry.storage_bytes))) {
      C10_THROW_ERROR(Error, "cannot read '" + entry.name + "' from " + path_ + " (record " +
                                 entry.record +
                                 "): its bytes fail the CRC-32 check (the file is damaged)");
    }
  }
  return storage.as_strided(entry.shape, entry.strides, entry.storage_offset);
}

}  // namespace hp::detail

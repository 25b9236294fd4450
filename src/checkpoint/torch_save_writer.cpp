#include "torch_save_writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <unordered_map>

#include "file_size_limit.h"

namespace hp::detail {
namespace {

// The record of the i-th tensor, as torch.save names it inside the archive's folder.
std::string record_name(size_t index) { return "data/" + std::to_string(index); }

// A tensor with dtype, shape and a storage of the right size but no data: what the
// pickler needs to write a tensor's entry without the tensor.
at::Tensor metadata_only(c10::ScalarType dtype, c10::IntArrayRef shape) {
  const int64_t bytes =
      c10::multiply_integers(shape) * static_cast<int64_t>(c10::elementSize(dtype));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, at::kCPU),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::dtype(dtype)).set_(storage, 0, shape);
}

}  // namespace

TorchSaveWriter::TorchSaveWriter(const std::string& path)
    : path_(path), partial_path_(path + ".partial") {
  let_oversized_writes_fail();
  file_ = std::fopen(partial_path_.c_str(), "wb");
  if (!file_) {
    C10_THROW_ERROR(Error, "cannot create checkpoint file " + path_ + " (writing " + partial_path_ +
                               "): " + std::strerror(errno));
  }
  // Records go to the file one after the other, the directory at the end, as Python's
  // torch.save writes. After a failed write (or when abandoned) bytes are dropped but
  // reported written: PyTorchStreamWriter then never enters its error state (from which
  // its destructor throws), and write() and finish() report write_errno_ themselves.
  archive_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>(
      [this](const void* data, size_t size) -> size_t {
        if (write_errno_ != 0 || abandoned_) return size;
        errno = 0;
        if (std::fwrite(data, 1, size, file_) != size) write_errno_ = errno != 0 ? errno : EIO;
        return size;
      });
}

TorchSaveWriter::~TorchSaveWriter() {
  if (finished_) return;
  // Finishing the archive into nothing here, so that PyTorchStreamWriter's destructor
  // (which would finish it) has nothing left to do; the partial file is removed.
  abandoned_ = true;
  if (!archive_->finalized()) {
    try {
      archive_->writeEndOfFile();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
    }
  }
  archive_.reset();
  close_file();
  std::remove(partial_path_.c_str());
}

std::string TorchSaveWriter::failure(const std::string& what, const std::string& reason) const {
  return "cannot write " + what + " to checkpoint file " + path_ + ": " +
         (write_errno_ != 0 ? write_error_text(write_errno_) : reason);
}

void TorchSaveWriter::close_file() {
  if (file_) std::fclose(file_);
  file_ = nullptr;
}

void TorchSaveWriter::write(const std::string& name, const at::Tensor& tensor) {
  if (!names_.insert(name).second) {
    C10_THROW_ERROR(ValueError, "'" + name + "' is written to " + path_ + " twice");
  }
  // The record holds the elements in row-major order, as the pickled strides will say.
  const at::Tensor data = tensor.detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
  try {
    archive_->writeRecord(record_name(written_.size()), data.data_ptr(), data.nbytes());
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(Error, failure("'" + name + "'", error.what_without_backtrace()));
  }
  if (write_errno_ != 0) C10_THROW_ERROR(Error, failure("'" + name + "'"));
  written_.push_back({name, data.scalar_type(), data.sizes().vec()});
}

void TorchSaveWriter::finish() {
  // The dict, pickled as torch.save does (no TorchScript type tags, so that torch.load's
  // weights_only unpickler accepts it), with each storage named by its record.
  c10::Dict<std::string, at::Tensor> dict;
  std::unordered_map<const c10::StorageImpl*, std::string> record_keys;
  for (size_t i = 0; i < written_.size(); ++i) {
    at::Tensor placeholder = metadata_only(written_[i].dtype, written_[i].shape);
    record_keys[placeholder.storage().unsafeGetStorageImpl()] = std::to_string(i);
    dict.insert(written_[i].name, placeholder);
  }
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      [&](const at::Tensor& tensor) {
        return record_keys.at(tensor.storage().unsafeGetStorageImpl());
      },
      /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  const std::string index = "the index of tensors (data.pkl)";
  try {
    archive_->writeRecord("data.pkl", pickled.data(), pickled.size());
    archive_->writeEndOfFile();
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(Error, failure(index, error.what_without_backtrace()));
  }
  if (write_errno_ != 0) C10_THROW_ERROR(Error, failure(index));
  // On disk before the rename, so that a crash never leaves a damaged file at path_.
  if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) {
    write_errno_ = errno;
    C10_THROW_ERROR(Error, failure("the last bytes"));
  }
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (closed != 0) {
    write_errno_ = errno;
    C10_THROW_ERROR(Error, failure("the last bytes"));
  }
  if (std::rename(partial_path_.c_str(), path_.c_str()) != 0) {
    C10_THROW_ERROR(Error, "cannot move the finished checkpoint " + partial_path_ + " to " + path_ +
                               ": " + std::strerror(errno));
  }
  finished_ = true;
}

}  // namespace hp::detail

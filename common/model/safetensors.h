#pragma once

// The safetensors file format: an 8-byte little-endian header length, a JSON header
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then data.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/mapped_file.h"
#include "common/kernels/dtype.h"

namespace preft::model {

// One tensor inside a mapped file. `data` borrows the mapping of the file it came from.
struct TensorInfo {
  std::string name;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t num_bytes = 0;
  std::string file;  // path, for error messages

  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// A parsed safetensors file. Immutable after Open; thread-safe to read.
class SafetensorsFile {
 public:
  // Maps `path` and validates the header: header length within the file, JSON well-formed,
  // every dtype supported (F32/F16/BF16), shape × dtype size == data_offsets span, offsets
  // inside the data section and not overlapping. Errors are InvalidArgument (DataLoss for
  // truncation) and start with the path.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // As Open, but reads the file into private memory (base::MappedFile::Read): for small files
  // whose tensors are copied once and dropped (adapters).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Read(const std::string& path);
  // As Read, from a descriptor the caller opened (base::OpenBeneath) and still owns.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> ReadOpened(int fd,
                                                                     const std::string& path);

  // Parses an in-memory image (the fuzz target's entry); `data` must outlive the result.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(std::string source,
                                                                const uint8_t* data, size_t size);

  const std::map<std::string, TensorInfo, std::less<>>& tensors() const { return tensors_; }
  const TensorInfo* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Size of the whole file image (header included).
  size_t size_bytes() const { return size_bytes_; }
  // Bytes of the mapping in huge pages (base::MappedFile::HugePageBytes).
  size_t huge_page_bytes() const { return file_ != nullptr ? file_->HugePageBytes() : 0; }

 private:
  SafetensorsFile() = default;
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromImage(
      absl::StatusOr<std::unique_ptr<base::MappedFile>> image);

  std::string path_;
  size_t size_bytes_ = 0;
  std::unique_ptr<base::MappedFile> file_;  // null when parsed from memory
  std::map<std::string, TensorInfo, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: `data` holds shape-product × dtype-size bytes.
struct TensorToWrite {
  std::string name;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file (tensors sorted by name, 8-byte aligned header as HF does).
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Name, dtype and shape of a tensor whose bytes come later (SafetensorsWriter).
struct TensorSpec {
  std::string name;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<int64_t> shape;

  // Bytes of the tensor's data; -1 when the shape is negative or the size overflows.
  int64_t num_bytes() const;
};

// Streams a safetensors file tensor by tensor, so a large file is never held in memory whole.
// Create writes the header; Append must then be called once per spec, in specs() order (sorted
// by name); Close checks that all came and flushes. Not thread-safe; one owner.
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorSpec> specs,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::vector<TensorSpec>& specs() const { return specs_; }
  // The spec the next Append writes, or null when all are written.
  const TensorSpec* next() const { return next_ < specs_.size() ? &specs_[next_] : nullptr; }
  // Writes the next tensor's bytes; `num_bytes` must equal its size.
  absl::Status Append(const void* data, size_t num_bytes);
  absl::Status Close();

 private:
  SafetensorsWriter() = default;
  absl::Status WriteAll(const void* data, size_t num_bytes);

  std::string path_;
  std::vector<TensorSpec> specs_;
  size_t next_ = 0;
  int fd_ = -1;
};

}  // namespace preft::model

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

  // Parses an in-memory image (the fuzz target's entry); `data` must outlive the result.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(std::string source,
                                                                const uint8_t* data, size_t size);

  const std::map<std::string, TensorInfo, std::less<>>& tensors() const { return tensors_; }
  const TensorInfo* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;

  std::string path_;
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

}  // namespace preft::model

#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace preft::base {

// A read-only image of a whole file. Open maps it: pages are shared with the page cache, so
// weights read through it cost no second copy; large files are mapped in huge pages where
// the kernel supports it (see mapped_file.cc). Read copies it into private memory instead,
// for small files that are read once and copied elsewhere (adapters). Immutable after
// Open/Read; thread-safe to read.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  static absl::StatusOr<std::unique_ptr<MappedFile>> Read(const std::string& path);
  // As Read, from a descriptor the caller opened (and still owns); `path` names it in errors.
  static absl::StatusOr<std::unique_ptr<MappedFile>> ReadOpened(int fd, const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Bytes of the mapping that sit in 2 MiB pages now (from /proc/self/smaps; 0 if unknown).
  size_t HugePageBytes() const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_;
  size_t size_;
  std::unique_ptr<uint8_t[]> copy_;  // Read's image (data_ points into it); null when mapped
  size_t copy_capacity_ = 0;
};

// Reads a whole (small) file into a string, e.g. a JSON config.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// As ReadFileToString, from an open descriptor (read to its end); `path` names it in errors.
absl::StatusOr<std::string> ReadOpenedToString(int fd, const std::string& path);

// Writes `contents` to `path` (truncating).
absl::Status WriteStringToFile(const std::string& path, const std::string& contents);

}  // namespace preft::base

#include "common/base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace preft::base {
namespace {

// Files from this size (model weights; not adapters or configs) are mapped in huge pages.
constexpr size_t kHugePageMinBytes = size_t{64} << 20;

// Maps a whole file read-only, in 2 MiB pages where the kernel can (file-backed transparent
// huge pages: Linux 6.x with large folios on ext4/xfs), else in 4 KiB pages as before.
// Measured in this project's VM (Zen 5, nested paging), where a TLB miss costs a
// two-dimensional page walk: qwen2.5-0.5b decode at batch 1 1.3-1.5x, 64 sequences 1.4x, a
// 128-token prefill 2.4x over 4 KiB pages (NOTES step 9).
void* MapInHugePages(int fd, size_t size) {
  // Cached pages are mapped in the folios they already have, small ones when the file was
  // just written; dropping those nobody maps lets readahead bring them back huge. Costs a
  // re-read from disk at load when the file was cached.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return p;
  ::madvise(p, size, MADV_HUGEPAGE);
  // Populated up front, as MAP_POPULATE would, but after the advice.
  if (::madvise(p, size, MADV_POPULATE_READ) != 0) {
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < size; i += 4096) sink = sink + static_cast<const uint8_t*>(p)[i];
  }
  return p;
}

// Buffers of recent Reads, kept for the next: a fresh buffer's page faults and zeroing cost
// about as much as the read itself (a 17.6 MB adapter: ~1.8 ms of each). A few are kept
// (one per loader thread suffices), none over kMaxPooledBytes.
class ReadBufferPool {
 public:
  static ReadBufferPool& Get() {
    static ReadBufferPool* pool = new ReadBufferPool;  // never destroyed: used at exit
    return *pool;
  }
  // A buffer of at least `size` bytes, not initialised; its capacity in *capacity.
  std::unique_ptr<uint8_t[]> Take(size_t size, size_t* capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity >= size) {
          std::unique_ptr<uint8_t[]> b = std::move(it->data);
          *capacity = it->capacity;
          free_.erase(it);
          return b;
        }
      }
    }
    *capacity = size;
    return std::make_unique_for_overwrite<uint8_t[]>(size);
  }
  void Give(std::unique_ptr<uint8_t[]> data, size_t capacity) {
    if (capacity > kMaxPooledBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() >= kMaxPooled) free_.erase(free_.begin());  // the oldest goes
    free_.push_back({std::move(data), capacity});
  }

 private:
  static constexpr size_t kMaxPooled = 4;
  static constexpr size_t kMaxPooledBytes = size_t{256} << 20;
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t capacity;
  };
  std::mutex mu_;
  std::vector<Buffer> free_;
};

// Opens `path` read-only and returns its size; a regular file or an error naming the path.
absl::StatusOr<size_t> OpenRegular(const std::string& path, int* fd) {
  // O_NONBLOCK: a FIFO in a file's place is refused below, not waited on.
  *fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (*fd < 0) {
    int err = errno;
    auto msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st;
  if (::fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(*fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  return static_cast<size_t>(st.st_size);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  int fd = -1;
  PREFT_ASSIGN_OR_RETURN(const size_t size, OpenRegular(path, &fd));
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = size >= kHugePageMinBytes ? MapInHugePages(fd, size)
                                        : ::mmap(nullptr, size, PROT_READ,
                                                 MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // The mapping keeps the file alive.
  return std::unique_ptr<MappedFile>(new MappedFile(path, data, size));
}

// Measured in this project's VM: the first pass over a freshly mapped 17.6 MB adapter file
// (already in the page cache, MAP_POPULATE) ran at ~2 GB/s, a second pass at ~25; a pread of
// the same file into memory at ~6 GB/s. Files read once are cheaper copied than mapped.
absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Read(const std::string& path) {
  int fd = -1;
  PREFT_RETURN_IF_ERROR(OpenRegular(path, &fd).status());
  absl::StatusOr<std::unique_ptr<MappedFile>> file = ReadOpened(fd, path);
  ::close(fd);
  return file;
}

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::ReadOpened(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) return std::unique_ptr<MappedFile>(new MappedFile(path, nullptr, 0));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  size_t capacity = 0;
  std::unique_ptr<uint8_t[]> copy = ReadBufferPool::Get().Take(size, &capacity);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, copy.get() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      return absl::DataLossError(absl::StrCat(
          path, ": read failed after ", done, " of ", size, " bytes",
          err != 0 ? absl::StrCat(": ", std::strerror(err)) : " (file shrank while read)"));
    }
    done += static_cast<size_t>(n);
  }
  auto file = std::unique_ptr<MappedFile>(new MappedFile(path, copy.get(), size));
  file->copy_ = std::move(copy);
  file->copy_capacity_ = capacity;
  return file;
}

size_t MappedFile::HugePageBytes() const {
  if (data_ == nullptr) return 0;
  // /proc/self/smaps: a header line per mapping ("start-end perms ..."), then its fields.
  std::ifstream smaps("/proc/self/smaps");
  const auto start = reinterpret_cast<uintptr_t>(data_);
  bool ours = false;
  std::string line;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      ours = lo == start;
      continue;
    }
    size_t kib = 0;
    if (ours && std::sscanf(line.c_str(), "FilePmdMapped: %zu kB", &kib) == 1) return kib << 10;
  }
  return 0;
}

MappedFile::~MappedFile() {
  if (copy_ != nullptr) {
    ReadBufferPool::Get().Give(std::move(copy_), copy_capacity_);
  } else if (data_ != nullptr) {
    ::munmap(const_cast<uint8_t*>(data_), size_);
  }
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return ss.str();
}

absl::StatusOr<std::string> ReadOpenedToString(int fd, const std::string& path) {
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DataLossError(absl::StrCat(path, ": read failed: ", std::strerror(errno)));
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

absl::Status WriteStringToFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace preft::base

#pragma once

// Opening files inside a folder so that nothing a client controls can lead outside it: no
// symbolic link is followed and no ".." climbs out, checked by the kernel on the very
// descriptor that is then read (a check on the path first, then an open, would race with a
// rename or a symlink swapped in between).

#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace preft::base {

// A file descriptor that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

enum class OpenKind { kFolder, kRegularFile };

// How OpenBeneath resolves: the kernel's openat2 (Linux 5.6+), or a walk that opens one
// component at a time with O_NOFOLLOW (older kernels, or where seccomp hides openat2).
enum class BeneathResolver { kAuto, kWalk };

// Opens `relative` (no leading "/", no "..") beneath the folder `dir_fd`, read-only, following
// no symbolic link on the way (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS). A regular file is opened
// so that a FIFO or device cannot block or be read. Errors name `relative`: NotFound when a
// component is missing, InvalidArgument for a symbolic link, an escape, or the wrong kind.
absl::StatusOr<Fd> OpenBeneath(int dir_fd, const std::string& relative, OpenKind kind,
                               BeneathResolver resolver = BeneathResolver::kAuto);

// The folder `path` itself (following links: it is the operator's choice, not a client's).
absl::StatusOr<Fd> OpenFolder(const std::string& path);

}  // namespace preft::base

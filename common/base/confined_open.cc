#include "common/base/confined_open.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace preft::base {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// O_NONBLOCK: opening a FIFO read-only would otherwise wait for a writer (a hang, not an
// error); it is refused by the fstat below instead, and reads of regular files never block.
int Flags(OpenKind kind) {
  return O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK |
         (kind == OpenKind::kFolder ? O_DIRECTORY : 0);
}

absl::Status OpenError(int err, const std::string& relative) {
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat(relative, ": No such file or directory"));
    case ELOOP:
      return absl::InvalidArgumentError(absl::StrCat(
          relative, ": a symbolic link is on the way; files under the adapter root must be "
                    "regular files in real folders"));
    case EXDEV:
      return absl::InvalidArgumentError(absl::StrCat(relative, ": leads outside its folder"));
    case ENOTDIR:
      return absl::InvalidArgumentError(absl::StrCat(relative, ": not a folder"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat(relative, ": permission denied"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(relative, ": cannot open: ", std::strerror(err)));
  }
}

// -1 with errno set, as open(2).
int OpenByOpenat2(int dir_fd, const std::string& relative, OpenKind kind) {
  struct open_how how = {};
  how.flags = static_cast<uint64_t>(Flags(kind));
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  for (;;) {
    const long fd = ::syscall(SYS_openat2, dir_fd, relative.c_str(), &how, sizeof(how));
    if (fd >= 0 || errno != EAGAIN) return static_cast<int>(fd);  // EAGAIN: a rename raced
  }
}

int OpenByWalk(int dir_fd, const std::string& relative, OpenKind kind) {
  const std::vector<std::string> parts = absl::StrSplit(relative, '/', absl::SkipEmpty());
  if (parts.empty()) {
    errno = ENOENT;
    return -1;
  }
  Fd current;
  int at = dir_fd;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i] == "..") {
      errno = EXDEV;
      return -1;
    }
    const bool last = i + 1 == parts.size();
    const int fd = ::openat(at, parts[i].c_str(),
                            (last ? Flags(kind) : Flags(OpenKind::kFolder)) | O_NOFOLLOW);
    if (fd < 0) {
      // O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR: say what it is.
      struct stat st;
      const int err = errno;
      errno = err == ENOTDIR && ::fstatat(at, parts[i].c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                      S_ISLNK(st.st_mode)
                  ? ELOOP
                  : err;
      return -1;
    }
    current = Fd(fd);
    at = fd;
  }
  return current.release();
}

}  // namespace

absl::StatusOr<Fd> OpenBeneath(int dir_fd, const std::string& relative, OpenKind kind,
                               BeneathResolver resolver) {
  if (relative.empty() || relative[0] == '/') {
    return absl::InvalidArgumentError(absl::StrCat("'", relative, "': not a relative path"));
  }
  int fd = -1;
  if (resolver == BeneathResolver::kAuto) {
    fd = OpenByOpenat2(dir_fd, relative, kind);
    // ENOSYS: a kernel before 5.6; EPERM: a seccomp profile that does not know openat2.
    if (fd < 0 && (errno == ENOSYS || errno == EPERM)) resolver = BeneathResolver::kWalk;
  }
  if (resolver == BeneathResolver::kWalk) fd = OpenByWalk(dir_fd, relative, kind);
  if (fd < 0) return OpenError(errno, relative);
  Fd opened(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return OpenError(errno, relative);
  if (kind == OpenKind::kRegularFile && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(relative, ": not a regular file"));
  }
  return opened;
}

absl::StatusOr<Fd> OpenFolder(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return OpenError(errno, path);
  return Fd(fd);
}

}  // namespace preft::base

#include "common/adapters/versioned_adapters.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace preft::adapters {

std::string VersionKey(const std::string& name, int64_t version) {
  return absl::StrCat(name, "@v", version);
}

absl::StatusOr<std::string> ResolveUnderRoot(const std::string& root, const std::string& dir) {
  namespace fs = std::filesystem;
  for (size_t i = 0; i < dir.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(dir[i]);
    if (c < 0x20 || c == 0x7F) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "adapter path has a control character (0x%02x) at byte %d", c, static_cast<int>(i)));
    }
  }
  if (root.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter path '", dir, "' refused: no adapter root is configured"));
  }
  std::error_code ec;
  const fs::path canonical_root = fs::canonical(root, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("adapter root '", root, "': ", ec.message()));
  const fs::path path = fs::path(dir).is_absolute() ? fs::path(dir) : canonical_root / dir;
  // Confinement is judged before existence (weakly_canonical resolves the symlinks that exist
  // and normalises the rest), so a path outside the root is refused as such whether or not it
  // exists, and the answer does not reveal what lies outside.
  const fs::path canonical = fs::weakly_canonical(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("adapter path '", dir, "': ", ec.message()));
  const std::string r = canonical_root.string() + "/";
  if (canonical.string().compare(0, r.size(), r) != 0) {
    // The message names what the client sent, never where the server keeps things.
    return absl::InvalidArgumentError(
        absl::StrCat("adapter path '", dir, "' is outside the adapter root"));
  }
  if (!fs::exists(canonical, ec)) {
    return absl::NotFoundError(absl::StrCat("adapter path '", dir, "': No such file or directory"));
  }
  if (!fs::is_directory(canonical, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("adapter path '", dir, "' is not a folder"));
  }
  // The folder is confined; its files must be too: a file that is a symbolic link (to weights
  // elsewhere, or to /etc/shadow) is refused, as is anything but a regular file.
  for (const char* file : {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"}) {
    const fs::file_status st = fs::symlink_status(canonical / file, ec);
    if (ec || st.type() == fs::file_type::not_found) continue;  // missing: the loader says so
    if (st.type() != fs::file_type::regular) {
      return absl::InvalidArgumentError(absl::StrCat(
          "adapter path '", dir, "': ", file,
          st.type() == fs::file_type::symlink ? " is a symbolic link" : " is not a regular file",
          "; files under the adapter root must be regular files"));
    }
  }
  return canonical.string();
}

void VersionedAdapters::Acquire(const std::string& name, int64_t version, const std::string& dir,
                                AdapterStore::AcquireCallback done) {
  absl::StatusOr<std::string> path = ResolveUnderRoot(root_, dir);
  if (!path.ok()) {
    done(path.status());
    return;
  }
  const std::string key = VersionKey(name, version);
  int64_t superseded_by = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = newest_.find(name);
    const int64_t newest = it == newest_.end() ? 0 : it->second;
    if (version < newest) superseded_by = newest;
    if (superseded_by == 0 && version > newest) {
      // AlreadyExists is fine (a racing caller registered it first).
      (void)store_->Register(key, *path);
      if (newest > 0) (void)store_->Unregister(VersionKey(name, newest));
      newest_[name] = version;
    }
  }
  if (superseded_by > 0) {  // answered outside the lock: `done` may call back in
    done(absl::FailedPreconditionError(absl::StrCat("adapter '", name, "' version ", version,
                                                    " was superseded by version ",
                                                    superseded_by)));
    return;
  }
  store_->Acquire(key, [done = std::move(done), name, version](absl::StatusOr<AdapterPin> l) {
    if (l.ok()) {  // report the router's name and version, not the store key
      l->name = name;
      l->version = version;
    }
    done(std::move(l));
  });
}

void VersionedAdapters::Forget(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = newest_.find(name);
  if (it == newest_.end()) return;
  (void)store_->Unregister(VersionKey(name, it->second));
  newest_.erase(it);
}

std::map<std::string, int64_t> VersionedAdapters::versions() const {
  absl::MutexLock lock(&mu_);
  return newest_;
}

}  // namespace preft::adapters

#include "services/router/adapter_registry.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/adapters/versioned_adapters.h"
#include "common/base/status_macros.h"

namespace preft::router {

absl::Status ValidateAdapterName(const std::string& name) {
  const bool ok_chars = std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
  if (name.empty() || name.size() > 128 || !ok_chars || name == "." || name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter name '", name, "' must be 1-128 characters from [A-Za-z0-9._-]"));
  }
  return absl::OkStatus();
}

namespace {

// Every folder the registry loads was named by a client: it is read beneath the root.
adapters::LoadOptions Confined(adapters::LoadOptions load, const std::string& root) {
  load.confine_to = root;
  return load;
}

}  // namespace

AdapterRegistry::AdapterRegistry(const model::ModelConfig& base, std::string base_name,
                                 std::string root, adapters::LoadOptions load,
                                 std::unique_ptr<RegistryStore> store)
    : base_(base),
      base_name_(std::move(base_name)),
      root_(std::move(root)),
      load_(Confined(std::move(load), root_)),
      store_(store != nullptr ? std::move(store) : std::make_unique<FileRegistryStore>(root_)) {
  std::error_code ec;
  const std::filesystem::path canonical = std::filesystem::canonical(root_, ec);
  canonical_root_ = ec ? root_ : canonical.string();
}

namespace {

// A loader error as the client may see it: paths relative to the adapter root (the root's
// location and the versions folder are the server's business), and a corrupt or truncated
// file is the client's bad input (InvalidArgument), not the server's DataLoss.
absl::Status ClientFacing(const absl::Status& s, const std::string& canonical_root,
                          const std::string& name) {
  std::string message(s.message());
  if (!canonical_root.empty()) {
    message = absl::StrReplaceAll(message, {{canonical_root + "/", ""}});
  }
  message = absl::StrReplaceAll(
      message, {{absl::StrCat(".preft-versions/", name, "/"), absl::StrCat(name, " update ")}});
  const absl::StatusCode code =
      s.code() == absl::StatusCode::kDataLoss ? absl::StatusCode::kInvalidArgument : s.code();
  return absl::Status(code, message);
}

}  // namespace

absl::StatusOr<RegisteredAdapter> AdapterRegistry::Inspect(const std::string& name,
                                                           const std::string& dir) const {
  absl::StatusOr<std::string> path = adapters::ResolveUnderRoot(root_, dir);
  if (!path.ok()) return ClientFacing(path.status(), canonical_root_, name);
  absl::StatusOr<std::unique_ptr<model::AdapterWeights>> weights =
      adapters::LoadAdapter(*path, base_, load_);
  if (!weights.ok()) return ClientFacing(weights.status(), canonical_root_, name);
  RegisteredAdapter a;
  a.name = name;
  a.path = *path;
  a.kind = (*weights)->kind();
  a.default_positions = (*weights)->default_positions;
  a.rank = (*weights)->max_rank();
  a.bytes = static_cast<int64_t>((*weights)->bytes());
  return a;
}

RegisteredAdapter AdapterRegistry::FromRecord(const RegistryRecord& r) const {
  RegisteredAdapter a;
  a.name = r.name;
  a.registered_path = r.registered_path;
  a.path = (std::filesystem::path(canonical_root_) / r.path).string();
  a.version = r.version;
  a.kind = r.kind;
  a.default_positions = r.default_positions;
  a.rank = r.rank;
  a.bytes = r.bytes;
  return a;
}

RegistryRecord AdapterRegistry::ToRecord(const RegisteredAdapter& a, const std::string& path) {
  return {a.name, a.registered_path, path, a.version, a.kind, a.default_positions, a.rank,
          a.bytes};
}

absl::StatusOr<RegisteredAdapter> AdapterRegistry::Register(const std::string& name,
                                                            const std::string& path) {
  PREFT_RETURN_IF_ERROR(ValidateAdapterName(name));
  if (name == base_name_) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter name '", name, "' is the base model's name"));
  }
  PREFT_ASSIGN_OR_RETURN(const int64_t existing, store_->CurrentVersion(name));
  if (existing > 0) {
    return absl::AlreadyExistsError(absl::StrCat("adapter '", name, "' is already registered"));
  }
  PREFT_ASSIGN_OR_RETURN(RegisteredAdapter a, Inspect(name, path));
  a.registered_path = path;
  a.version = 1;
  const absl::Status created = store_->Create(ToRecord(a, path));
  if (absl::IsAlreadyExists(created)) {  // another router registered it meanwhile
    return absl::AlreadyExistsError(absl::StrCat("adapter '", name, "' is already registered"));
  }
  PREFT_RETURN_IF_ERROR(created);
  return FromRecord(ToRecord(a, path));
}

absl::StatusOr<RegisteredAdapter> AdapterRegistry::Get(const std::string& name) const {
  // One directory listing (or one indexed query) tells whether the cached record is still the
  // current one (another router may have updated or removed it).
  PREFT_ASSIGN_OR_RETURN(const int64_t version, store_->CurrentVersion(name));
  absl::MutexLock lock(&mu_);
  if (version == 0) {
    cache_.erase(name);
    return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
  }
  auto it = cache_.find(name);
  if (it != cache_.end() && it->second.version == version) return it->second;
  PREFT_ASSIGN_OR_RETURN(RegistryRecord r, store_->Read(name, version));
  RegisteredAdapter a = FromRecord(r);
  cache_[name] = a;
  return a;
}

absl::Status AdapterRegistry::Unregister(const std::string& name) {
  PREFT_RETURN_IF_ERROR(store_->Remove(name));
  absl::MutexLock lock(&mu_);
  cache_.erase(name);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegisteredAdapter>> AdapterRegistry::List() const {
  std::vector<RegisteredAdapter> out;
  PREFT_ASSIGN_OR_RETURN(const std::vector<RegistryRecord> records, store_->List());
  for (const RegistryRecord& r : records) out.push_back(FromRecord(r));
  return out;
}

absl::StatusOr<RegisteredAdapter> AdapterRegistry::Update(
    const std::string& name, std::optional<int64_t> expected_version,
    const std::map<std::string, std::string>& files) {
  namespace fs = std::filesystem;
  if (files.empty()) return absl::InvalidArgumentError("no files were sent");
  for (const auto& [file, bytes] : files) {
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      return absl::InvalidArgumentError(absl::StrCat("file name '", file, "' is not a plain name"));
    }
  }
  absl::MutexLock update_lock(&update_mu_);
  static std::atomic<uint64_t> attempts{0};
  for (int attempt = 0; attempt < 16; ++attempt) {
    PREFT_ASSIGN_OR_RETURN(RegisteredAdapter current, Get(name));
    if (expected_version && *expected_version != current.version) {
      return absl::FailedPreconditionError(absl::StrCat("adapter '", name, "' is at version ",
                                                        current.version, ", not ",
                                                        *expected_version));
    }
    const int64_t version = current.version + 1;
    // A folder of this attempt's own (routers sharing the root may race for the version);
    // named relative to the root, as registered paths are.
    const fs::path relative =
        fs::path(".preft-versions") / name /
        absl::StrCat("v", version, "-", getpid(), "-", attempts.fetch_add(1));
    const fs::path dir = fs::path(root_) / relative;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot store the update: ", ec.message()));
    for (const auto& [file, bytes] : files) {
      std::ofstream out(dir / file, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      if (!out) return absl::InternalError("cannot store the update's files");
    }
    absl::StatusOr<RegisteredAdapter> next = Inspect(name, relative.string());
    if (!next.ok()) {
      fs::remove_all(dir, ec);
      return next.status();
    }
    next->registered_path = current.registered_path;
    next->version = version;
    const absl::Status created = store_->Create(ToRecord(*next, relative.string()));
    if (created.ok()) return FromRecord(ToRecord(*next, relative.string()));
    fs::remove_all(dir, ec);
    if (!absl::IsAlreadyExists(created)) return created;
    if (expected_version) {  // another router made this version first
      return absl::FailedPreconditionError(absl::StrCat(
          "adapter '", name, "' is at version ", version, " or later, not ", *expected_version));
    }
  }
  return absl::AbortedError(absl::StrCat("adapter '", name, "' changed during every attempt"));
}

}  // namespace preft::router

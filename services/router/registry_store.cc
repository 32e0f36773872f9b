#include "services/router/registry_store.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "services/router/registry_postgres.h"

namespace preft::router {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kFolder[] = ".preft-registry";

// A name unique to this process and call, for temporary files.
std::string Nonce() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t seed = std::random_device{}();
  return absl::StrCat(getpid(), "-", seed % 1000000, "-", counter.fetch_add(1));
}

// v<N>.json -> N; 0 for anything else.
int64_t VersionOf(const std::string& file) {
  int64_t v = 0;
  if (file.size() < 7 || file[0] != 'v' || file.substr(file.size() - 5) != ".json") return 0;
  return absl::SimpleAtoi(file.substr(1, file.size() - 6), &v) && v > 0 ? v : 0;
}

json ToJson(const RegistryRecord& r) {
  return {{"name", r.name},
          {"registered_path", r.registered_path},
          {"path", r.path},
          {"version", r.version},
          {"kind", model::AdapterKindName(r.kind)},
          {"default_positions", model::AdapterPositionsName(r.default_positions)},
          {"rank", r.rank},
          {"bytes", r.bytes}};
}

}  // namespace

std::string FileRegistryStore::Folder(const std::string& name) const {
  return (fs::path(root_) / kFolder / name).string();
}

absl::Status FileRegistryStore::Create(const RegistryRecord& r) const {
  const std::string folder = Folder(r.name);
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("adapter registry: ", ec.message()));
  const std::string tmp = absl::StrCat(folder, "/.tmp-", Nonce());
  PREFT_RETURN_IF_ERROR(base::WriteStringToFile(tmp, ToJson(r).dump()));
  const std::string final_name = absl::StrCat(folder, "/v", r.version, ".json");
  const int rc = ::link(tmp.c_str(), final_name.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (rc == 0) return absl::OkStatus();
  if (err == EEXIST) {
    return absl::AlreadyExistsError(
        absl::StrCat("adapter '", r.name, "' version ", r.version, " exists"));
  }
  return absl::InternalError(absl::StrCat("adapter registry: ", std::strerror(err)));
}

absl::StatusOr<int64_t> FileRegistryStore::CurrentVersion(const std::string& name) const {
  std::error_code ec;
  int64_t best = 0;
  for (const auto& entry : fs::directory_iterator(Folder(name), ec)) {
    best = std::max(best, VersionOf(entry.path().filename().string()));
  }
  return best;
}

absl::StatusOr<RegistryRecord> FileRegistryStore::Read(const std::string& name,
                                                       int64_t version) const {
  const std::string file = absl::StrCat(Folder(name), "/v", version, ".json");
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(file));
  const json j = json::parse(text, nullptr, false);
  RegistryRecord r;
  // Every field of its type before any is read (json::value throws on another type).
  auto typed = [&](const char* field, bool (json::*is)() const noexcept) {
    return !j.contains(field) || (j[field].*is)();
  };
  if (j.is_discarded() || !j.is_object() || !j.contains("path") || !j["path"].is_string() ||
      !typed("registered_path", &json::is_string) || !typed("kind", &json::is_string) ||
      !typed("default_positions", &json::is_string) ||
      !typed("rank", &json::is_number_integer) || !typed("bytes", &json::is_number_integer)) {
    return absl::DataLossError(absl::StrCat("adapter registry: the record of '", name,
                                            "' version ", version, " is unreadable"));
  }
  r.name = name;
  r.version = version;
  r.registered_path = j.value("registered_path", "");
  r.path = j["path"].get<std::string>();
  r.kind = j.value("kind", "lora") == "direft" ? model::AdapterKind::kDireft
                                               : model::AdapterKind::kLora;
  model::ParseAdapterPositions(j.value("default_positions", "all"), &r.default_positions);
  r.rank = j.value("rank", int64_t{0});
  r.bytes = j.value("bytes", int64_t{0});
  return r;
}

absl::StatusOr<RegistryRecord> RegistryStore::Current(const std::string& name) const {
  PREFT_ASSIGN_OR_RETURN(const int64_t version, CurrentVersion(name));
  if (version == 0) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
  }
  return Read(name, version);
}

absl::StatusOr<std::vector<RegistryRecord>> FileRegistryStore::List() const {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(root_) / kFolder, ec)) {
    const std::string n = entry.path().filename().string();
    if (!n.empty() && n[0] != '.' && entry.is_directory(ec)) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  std::vector<RegistryRecord> out;
  for (const std::string& n : names) {
    if (auto r = Current(n); r.ok()) out.push_back(*std::move(r));
  }
  return out;
}

absl::Status FileRegistryStore::Remove(const std::string& name) const {
  const std::string folder = Folder(name);
  const std::string gone = absl::StrCat(root_, "/", kFolder, "/.removed-", name, "-", Nonce());
  std::error_code ec;
  if (*CurrentVersion(name) == 0) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
  }
  fs::rename(folder, gone, ec);  // atomic: readers see all of it or none
  if (ec) {
    if (!fs::exists(folder)) {
      return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
    }
    return absl::InternalError(absl::StrCat("adapter registry: ", ec.message()));
  }
  fs::remove_all(gone, ec);
  return absl::OkStatus();
}

absl::Status FileRegistryStore::SetPreload(const std::string& name, bool preload) const {
  if (*CurrentVersion(name) == 0) {
    return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
  }
  const std::string marker = Folder(name) + "/preload";
  std::error_code ec;
  if (!preload) {
    fs::remove(marker, ec);
    return absl::OkStatus();
  }
  if (fs::exists(marker, ec)) return absl::OkStatus();
  return base::WriteStringToFile(marker, "");
}

absl::StatusOr<std::vector<std::string>> FileRegistryStore::Preloaded() const {
  std::vector<std::string> out;
  PREFT_ASSIGN_OR_RETURN(const std::vector<RegistryRecord> all, List());
  for (const RegistryRecord& r : all) {
    std::error_code ec;
    if (fs::exists(Folder(r.name) + "/preload", ec)) out.push_back(r.name);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<RegistryStore>> OpenRegistryStore(const std::string& url,
                                                                 const std::string& root) {
  if (url.empty() || url == "file") return std::make_unique<FileRegistryStore>(root);
  if (absl::StartsWith(url, "postgresql://") || absl::StartsWith(url, "postgres://")) {
    PREFT_ASSIGN_OR_RETURN(std::unique_ptr<PostgresRegistryStore> pg,
                           PostgresRegistryStore::Connect(url));
    return std::unique_ptr<RegistryStore>(std::move(pg));
  }
  return absl::InvalidArgumentError(
      "the registry is \"file\" (the adapter root) or a postgresql:// URI");
}

}  // namespace preft::router

#pragma once

// The adapter registry's durable records, kept in the adapter root so that every router that
// mounts the root (a restarted one, or a second replica) sees the same adapters and versions
// with nothing else to run: `<root>/.preft-registry/<name>/v<N>.json`, one file per version.
// A version file is written under a temporary name and then hard-linked to its final name;
// link() fails when the name exists, so creating version N+1 is a compare-and-swap on a shared
// POSIX volume: of two routers updating the same adapter at once, exactly one wins. The current
// version is the highest file. Removing a name renames its folder away first, so it vanishes at
// once for every reader. Where the root's volume lacks POSIX link() semantics (object-store
// FUSE mounts), the same records go to PostgreSQL (registry_postgres.h).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/adapter_weights.h"

namespace preft::router {

struct RegistryRecord {
  std::string name;
  std::string registered_path;  // as given at registration (relative to the root)
  std::string path;             // this version's folder, relative to the root
  int64_t version = 0;
  model::AdapterKind kind = model::AdapterKind::kLora;
  model::AdapterPositions default_positions = model::AdapterPositions::kAll;
  int64_t rank = 0;
  int64_t bytes = 0;
};

// Where registrations live. Thread-safe, and safe across processes (routers) sharing it.
class RegistryStore {
 public:
  virtual ~RegistryStore() = default;
  // AlreadyExists when `r.version` of `r.name` exists (for version 1: the name is taken).
  virtual absl::Status Create(const RegistryRecord& r) const = 0;
  // The highest version of `name`; NotFound when it has none.
  absl::StatusOr<RegistryRecord> Current(const std::string& name) const;
  // The highest version of `name`, or 0 (cheap: checked on every lookup).
  virtual absl::StatusOr<int64_t> CurrentVersion(const std::string& name) const = 0;
  // Version `version` of `name` (NotFound when absent, DataLoss when unreadable).
  virtual absl::StatusOr<RegistryRecord> Read(const std::string& name, int64_t version) const = 0;
  // Every name's current record, by name.
  virtual absl::StatusOr<std::vector<RegistryRecord>> List() const = 0;
  // NotFound when `name` has no record; its preload mark goes with it.
  virtual absl::Status Remove(const std::string& name) const = 0;
  // Whether `name` is loaded ahead of traffic, so that a worker that rejoins gets it again,
  // whichever router sees the rejoin and after restarts. NotFound for an unknown name.
  virtual absl::Status SetPreload(const std::string& name, bool preload) const = 0;
  virtual absl::StatusOr<std::vector<std::string>> Preloaded() const = 0;
};

// The default store: files in the adapter root (see above). Errors are Internal.
class FileRegistryStore final : public RegistryStore {
 public:
  explicit FileRegistryStore(std::string root) : root_(std::move(root)) {}

  absl::Status Create(const RegistryRecord& r) const override;
  absl::StatusOr<int64_t> CurrentVersion(const std::string& name) const override;
  absl::StatusOr<RegistryRecord> Read(const std::string& name, int64_t version) const override;
  absl::StatusOr<std::vector<RegistryRecord>> List() const override;
  absl::Status Remove(const std::string& name) const override;
  absl::Status SetPreload(const std::string& name, bool preload) const override;
  absl::StatusOr<std::vector<std::string>> Preloaded() const override;

 private:
  std::string Folder(const std::string& name) const;

  const std::string root_;
};

// The store `url` names: "" or "file" for the files in `root`; a PostgreSQL connection URI
// ("postgresql://user@host:5432/db", libpq's syntax, a password from ~/.pgpass or PGPASSWORD)
// for PostgresRegistryStore. InvalidArgument for anything else; Unavailable when the database
// cannot be reached (the message never repeats the URI, which may hold a password).
absl::StatusOr<std::unique_ptr<RegistryStore>> OpenRegistryStore(const std::string& url,
                                                                 const std::string& root);

}  // namespace preft::router

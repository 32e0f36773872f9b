#pragma once

// The adapter registry's records in PostgreSQL, for deployments whose shared adapter volume
// lacks POSIX link() semantics (object-store FUSE mounts), or that already run a database for
// state: `preft-router --registry postgresql://...`. Two tables, made when missing:
//   preft_adapter_versions (name, version, ...) PRIMARY KEY (name, version)
//   preft_adapter_preload  (name PRIMARY KEY)
// Creating version N+1 is an INSERT that the primary key lets exactly one router win, the
// same compare-and-swap the file store gets from link(). The adapters' bytes stay on the
// shared volume (workers load them from there); only the records move.

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "services/router/registry_store.h"

struct pg_conn;

namespace preft::router {

// One connection, used under a lock (a lookup is one indexed query); a broken connection is
// re-opened once per call before the call fails Unavailable.
class PostgresRegistryStore final : public RegistryStore {
 public:
  // Connects and creates the tables when missing. Unavailable, naming libpq's reason but never
  // the URI (it may hold a password), when the database cannot be used.
  static absl::StatusOr<std::unique_ptr<PostgresRegistryStore>> Connect(const std::string& uri);
  ~PostgresRegistryStore() override;

  absl::Status Create(const RegistryRecord& r) const override;
  absl::StatusOr<int64_t> CurrentVersion(const std::string& name) const override;
  absl::StatusOr<RegistryRecord> Read(const std::string& name, int64_t version) const override;
  absl::StatusOr<std::vector<RegistryRecord>> List() const override;
  absl::Status Remove(const std::string& name) const override;
  absl::Status SetPreload(const std::string& name, bool preload) const override;
  absl::StatusOr<std::vector<std::string>> Preloaded() const override;

  class Rows;  // a query's result

 private:
  explicit PostgresRegistryStore(std::string uri) : uri_(std::move(uri)) {}
  // Runs `sql` with text parameters; AlreadyExists for a unique violation.
  absl::StatusOr<Rows> Query(const char* sql, const std::vector<std::string>& params) const;
  absl::Status Reconnect() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string uri_;
  mutable absl::Mutex mu_;
  mutable pg_conn* conn_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace preft::router

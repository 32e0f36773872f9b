#pragma once

// The adapter registry's durable records, kept in the adapter root so that every router that
// mounts the root (a restarted one, or a second replica) sees the same adapters and versions
// with nothing else to run: `<root>/.preft-registry/<name>/v<N>.json`, one file per version.
// A version file is written under a temporary name and then hard-linked to its final name;
// link() fails when the name exists, so creating version N+1 is a compare-and-swap on a shared
// POSIX volume: of two routers updating the same adapter at once, exactly one wins. The current
// version is the highest file. Removing a name renames its folder away first, so it vanishes at
// once for every reader.

#include <cstdint>
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

// Thread-safe (the file system is the only state); safe across processes sharing the root.
class RegistryStore {
 public:
  explicit RegistryStore(std::string root) : root_(std::move(root)) {}

  // AlreadyExists when `r.version` of `r.name` exists (for version 1: the name is taken);
  // Internal for a file system failure.
  absl::Status Create(const RegistryRecord& r) const;
  // The highest version of `name`; NotFound when it has none.
  absl::StatusOr<RegistryRecord> Current(const std::string& name) const;
  // The highest version of `name`, or 0 (cheap: one directory listing).
  int64_t CurrentVersion(const std::string& name) const;
  // Version `version` of `name` (NotFound when absent, DataLoss when unreadable).
  absl::StatusOr<RegistryRecord> Read(const std::string& name, int64_t version) const;
  // Every name's current record, by name.
  std::vector<RegistryRecord> List() const;
  // NotFound when `name` has no record.
  absl::Status Remove(const std::string& name) const;
  // Whether `name` is loaded ahead of traffic (a `preload` file beside its records), so that a
  // worker that rejoins gets it again, whichever router sees the rejoin and after restarts.
  absl::Status SetPreload(const std::string& name, bool preload) const;
  std::vector<std::string> Preloaded() const;

 private:
  std::string Folder(const std::string& name) const;

  const std::string root_;
};

}  // namespace preft::router

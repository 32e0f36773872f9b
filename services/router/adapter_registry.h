#pragma once

// The router's list of adapters: name -> (folder under the adapter root, version, what it is).
// Registration validates the folder against the base model (a full load, then dropped: the
// router computes nothing) so a bad adapter is refused at the admin call, not at the first
// request. UpdateAdapter's streamed files are written to a new folder
// `<root>/.preft-versions/<name>/v<N>` and validated before the version changes; workers read
// every version from the same root (a shared volume in Kubernetes).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/adapters/adapter_loader.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::router {

struct RegisteredAdapter {
  std::string name;
  std::string registered_path;  // as given at registration (relative to the root)
  std::string path;             // canonical folder of the current version
  int64_t version = 0;
  model::AdapterKind kind = model::AdapterKind::kLora;
  model::AdapterPositions default_positions = model::AdapterPositions::kAll;
  int64_t rank = 0;
  int64_t bytes = 0;  // in the compute dtype
};

// Thread-safe.
class AdapterRegistry {
 public:
  AdapterRegistry(const model::ModelConfig& base, std::string base_name, std::string root,
                  adapters::LoadOptions load);

  // InvalidArgument for a bad name or a path outside the root, AlreadyExists for a taken name,
  // the loader's error for a bad adapter.
  absl::StatusOr<RegisteredAdapter> Register(const std::string& name, const std::string& path);
  // NotFound if unknown.
  absl::StatusOr<RegisteredAdapter> Get(const std::string& name) const;
  absl::Status Unregister(const std::string& name);
  std::vector<RegisteredAdapter> List() const;  // by name

  // A new version from files (file name -> bytes). FailedPrecondition when `expected_version`
  // is set and is not the current one; InvalidArgument for a file name with a path in it.
  absl::StatusOr<RegisteredAdapter> Update(const std::string& name,
                                           std::optional<int64_t> expected_version,
                                           const std::map<std::string, std::string>& files);

 private:
  absl::StatusOr<RegisteredAdapter> Inspect(const std::string& name, const std::string& dir) const;

  const model::ModelConfig base_;
  const std::string base_name_;
  const std::string root_;
  const adapters::LoadOptions load_;
  mutable absl::Mutex mu_;
  std::map<std::string, RegisteredAdapter> adapters_ ABSL_GUARDED_BY(mu_);
  absl::Mutex update_mu_;  // one UpdateAdapter at a time (they write folders)
};

// 1-128 characters from [A-Za-z0-9._-]; InvalidArgument naming the name otherwise.
absl::Status ValidateAdapterName(const std::string& name);

}  // namespace preft::router

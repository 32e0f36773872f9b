#pragma once

// The router's list of adapters: name -> (folder under the adapter root, version, what it is),
// kept durably in the adapter root (RegistryStore), so it survives restarts and every router
// sharing the root sees the same adapters and versions.
// Registration validates the folder against the base model (a full load, then dropped: the
// router computes nothing) so a bad adapter is refused at the admin call, not at the first
// request. UpdateAdapter's streamed files are written to a new folder
// `<root>/.preft-versions/<name>/v<N>-<attempt>` and validated before the version record is
// created; of two routers racing for version N, the store lets exactly one create it. Workers
// read every version from the same root (a shared volume in Kubernetes).

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
#include "services/router/registry_store.h"

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
  // `store`: where records live (OpenRegistryStore); null: the files in `root`.
  AdapterRegistry(const model::ModelConfig& base, std::string base_name, std::string root,
                  adapters::LoadOptions load, std::unique_ptr<RegistryStore> store = nullptr);

  // InvalidArgument for a bad name or a path outside the root, AlreadyExists for a taken name,
  // the loader's error for a bad adapter.
  absl::StatusOr<RegisteredAdapter> Register(const std::string& name, const std::string& path);
  // NotFound if unknown. Reflects other routers' registrations, updates and removals.
  absl::StatusOr<RegisteredAdapter> Get(const std::string& name) const;
  absl::Status Unregister(const std::string& name);
  absl::StatusOr<std::vector<RegisteredAdapter>> List() const;  // by name

  // Adapters loaded ahead of traffic, kept with the registry (durable, shared by routers).
  absl::Status SetPreload(const std::string& name, bool preload) {
    return store_->SetPreload(name, preload);
  }
  absl::StatusOr<std::vector<std::string>> Preloaded() const { return store_->Preloaded(); }

  // A new version from files (file name -> bytes). FailedPrecondition when `expected_version`
  // is set and is not the current one; InvalidArgument for a file name with a path in it.
  absl::StatusOr<RegisteredAdapter> Update(const std::string& name,
                                           std::optional<int64_t> expected_version,
                                           const std::map<std::string, std::string>& files);

 private:
  absl::StatusOr<RegisteredAdapter> Inspect(const std::string& name, const std::string& dir) const;
  RegisteredAdapter FromRecord(const RegistryRecord& r) const;
  static RegistryRecord ToRecord(const RegisteredAdapter& a, const std::string& path);

  const model::ModelConfig base_;
  const std::string base_name_;
  const std::string root_;
  std::string canonical_root_;  // root_ resolved once (workers get absolute version folders)
  const adapters::LoadOptions load_;
  const std::unique_ptr<RegistryStore> store_;
  mutable absl::Mutex mu_;
  // Records read from the store, by name: reused while their version is the current one.
  mutable std::map<std::string, RegisteredAdapter> cache_ ABSL_GUARDED_BY(mu_);
  absl::Mutex update_mu_;  // one UpdateAdapter at a time in this process
};

// 1-128 characters from [A-Za-z0-9._-]; InvalidArgument naming the name otherwise.
absl::Status ValidateAdapterName(const std::string& name);

}  // namespace preft::router

#pragma once

// Adapters as workers see them: the router names each request's adapter by (name, version,
// folder), and a worker must run exactly that version. Each version is its own entry
// ("name@vN") in the worker's AdapterStore, registered on first sight; a newer version retires
// the older ones (their pins keep the weights until requests on them finish), so an RL
// weight update never changes a request mid-flight and stale copies leave memory by themselves.
// Folders must lie under the configured root (after resolving symlinks and "..").

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/adapters/adapter_store.h"

namespace preft::adapters {

// The store key of one version.
std::string VersionKey(const std::string& name, int64_t version);

// InvalidArgument (naming the path and the root) unless `dir` resolves to a folder under
// `root`; NotFound if it does not exist. Returns the canonical path.
absl::StatusOr<std::string> ResolveUnderRoot(const std::string& root, const std::string& dir);

// Thread-safe. Borrows the store.
class VersionedAdapters {
 public:
  VersionedAdapters(AdapterStore* store, std::string root)
      : store_(store), root_(std::move(root)) {}

  // Pins (name, version) from `dir`: `done` is called as AdapterStore::Acquire does. A
  // version older than the newest seen for the name is FailedPrecondition (the router moved
  // on); a bad path is answered at once with ResolveUnderRoot's error.
  void Acquire(const std::string& name, int64_t version, const std::string& dir,
               AdapterStore::AcquireCallback done);

  // Forgets `name`: its newest version leaves the store (pins keep their weights until
  // released); a later Acquire registers it afresh. OK if the name was never seen.
  void Forget(const std::string& name);

  // The newest version seen per name.
  std::map<std::string, int64_t> versions() const;

 private:
  AdapterStore* const store_;
  const std::string root_;
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> newest_ ABSL_GUARDED_BY(mu_);
};

}  // namespace preft::adapters

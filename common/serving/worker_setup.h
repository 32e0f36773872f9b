#pragma once

// What every preft worker process does the same way before it serves: load the base model
// and tokenizer, size the engine, pick the KV transport, describe the KV layout, and wait for
// SIGTERM. Shared by preft-prefill, preft-decode and `preft serve`.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "common/model/tokenizer.h"
#include "common/transport/kv_transport.h"

namespace preft::serving {

struct LoadedModel {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<model::Tokenizer> tokenizer;  // null if the folder has no tokenizer.json
  // Identifies the base weights in KV layouts: two workers exchange KV only if they agree.
  // Architecture, a hash of config.json and the weight files' sizes (no full-file hash: a
  // real checkpoint is gigabytes).
  std::string fingerprint;
};

// Errors name the folder and the problem (the loaders' messages).
absl::StatusOr<LoadedModel> LoadModel(const std::string& dir);

struct TransportFlags {
  std::string kind = "ucx";  // "ucx" or "inproc" (one process only)
  std::string ucx_tls;       // UCX_TLS for this worker ("" = environment / UCX default)
  std::string ucx_net_devices;
};

// InvalidArgument for an unknown kind.
absl::StatusOr<std::unique_ptr<transport::KvTransport>> MakeTransport(const TransportFlags& flags);

// Readiness: OK unless UCX was configured with explicit transports (`ucx_tls`) and the ones it
// opened, named in `opened` ("ucx(posix,self)"), differ (FailedPrecondition naming both). UCX
// aliases (shm, sm, ib, all, ...) are not checked.
absl::Status CheckTransport(const std::string& opened, const TransportFlags& flags);

// The engine cache's layout under `fingerprint`.
transport::KvLayout LayoutFor(engine::Engine& engine, const std::string& fingerprint);

// Routes SIGTERM and SIGINT to WaitForTerminationSignal: a handler (whichever thread the
// kernel picks, including threads libraries started before main) writes the signal to a pipe.
// Call it early in main ...
void InstallTerminationHandler();
// ... then wait for one; returns its number.
int WaitForTerminationSignal();

}  // namespace preft::serving

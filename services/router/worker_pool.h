#pragma once

// The router's view of its workers: membership from flags (host:port) or DNS (dns:NAME:PORT,
// e.g. a Kubernetes headless service, re-resolved periodically), one channel and stub per
// worker, and each worker's last Status, polled in the background. A worker that fails a
// poll, or a call with UNAVAILABLE, is unhealthy until it answers a poll again.

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/base/thread_pool.h"
#include "proto/preft/v1/worker.grpc.pb.h"
#include "services/router/decode_streams.h"
#include "services/router/routing.h"

namespace preft::router {

struct WorkerPoolOptions {
  std::vector<std::string> prefill;  // "host:port" or "dns:NAME:PORT"
  std::vector<std::string> decode;
  absl::Duration poll_interval = absl::Milliseconds(100);
  // How workers are dialled (TLS, mutual TLS); null: plaintext. Unused with make_channel.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Duration poll_timeout = absl::Milliseconds(1000);
  absl::Duration dns_refresh = absl::Seconds(5);
  // Makes the channel to a worker address (tests and `preft serve` may pass their own).
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
  // Threads that relay decode workers' tokens to clients, below the router's other threads in
  // priority (see DecodeStreams::OnReadDone); 0: on gRPC's callback threads.
  int relay_threads = 2;
};

struct DecodeWorker {
  std::string address;
  std::unique_ptr<worker::v1::DecodeWorker::Stub> stub;
  base::ThreadPool* relay = nullptr;  // the pool's relay threads (null: relay inline)
  mutable absl::Mutex mu;
  DecodeView view ABSL_GUARDED_BY(mu);
  worker::v1::DecodeStatusResponse status ABSL_GUARDED_BY(mu);  // the last poll's answer
  // Until then view.kv_path_suspect holds (the poll does not clear it).
  absl::Time kv_path_suspect_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();

  // KV sent to this worker did not arrive: rank it last for `hold` (see DecodeView).
  void SuspectKvPath(absl::Duration hold) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    kv_path_suspect_until = absl::Now() + hold;
  }

  // A Start or Run stream on this worker, over its one Streams call (opened at first use, and
  // again once it has ended). A stream that could not be opened has ended UNAVAILABLE.
  std::shared_ptr<DecodeStream> OpenStream(worker::v1::StreamOpen open)
      ABSL_LOCKS_EXCLUDED(streams_mu);
  // Closes the Streams call once no stream is open on it (the worker drains: let it exit).
  void CloseStreamsWhenIdle() ABSL_LOCKS_EXCLUDED(streams_mu);
  // Ends the Streams call and waits for gRPC to be done with it (the pool's end).
  void ShutdownStreams() ABSL_LOCKS_EXCLUDED(streams_mu);
  ~DecodeWorker();

 private:
  absl::Mutex streams_mu;
  std::shared_ptr<DecodeStreams> streams ABSL_GUARDED_BY(streams_mu);
};

struct PrefillWorker {
  std::string address;
  std::unique_ptr<worker::v1::PrefillWorker::Stub> stub;
  mutable absl::Mutex mu;
  PrefillView view ABSL_GUARDED_BY(mu);
  worker::v1::PrefillStatusResponse status ABSL_GUARDED_BY(mu);
};

// Addresses a spec names: itself, or for "dns:NAME:PORT" every address NAME resolves to.
// InvalidArgument for a malformed spec; Unavailable when the name does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveSpec(const std::string& spec);

// Thread-safe.
class WorkerPool {
 public:
  // Resolves and polls once before returning (so a fresh router routes at once), then keeps
  // polling on its own thread.
  explicit WorkerPool(WorkerPoolOptions options);
  ~WorkerPool();

  std::vector<std::shared_ptr<DecodeWorker>> decode() const;
  std::vector<std::shared_ptr<PrefillWorker>> prefill() const;

  // Call failed with UNAVAILABLE: skip the worker until it answers a poll.
  static void MarkUnhealthy(DecodeWorker& w);
  static void MarkUnhealthy(PrefillWorker& w);
  // Polls every worker now (tests; after membership changes).
  void PollNow();

  // `fn` hears of every prefill worker that answers a poll after not answering (restarted,
  // or new): the router loads preloaded adapters onto it again. Called on the polling thread,
  // outside the pool's locks; null stops the calls, and once this returns none is running.
  using RejoinCallback = std::function<void(const std::shared_ptr<PrefillWorker>&)>;
  void OnPrefillRejoin(RejoinCallback fn);

 private:
  void Refresh();  // membership
  void Run();

  const WorkerPoolOptions options_;
  std::unique_ptr<base::ThreadPool> relay_;  // outlives every Streams call (see ~WorkerPool)
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<DecodeWorker>> decode_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<PrefillWorker>> prefill_ ABSL_GUARDED_BY(mu_);
  absl::Time last_refresh_ = absl::InfinitePast();
  absl::Mutex rejoin_mu_;  // held while the callback runs
  RejoinCallback rejoin_ ABSL_GUARDED_BY(rejoin_mu_);
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace preft::router

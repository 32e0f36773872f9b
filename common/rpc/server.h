#pragma once

// Starting and stopping a gRPC server the same way in every preft service: plaintext or TLS
// (tls.h), one port, no port sharing, message size limits, the built-in grpc.health.v1
// service and server reflection (grpc.reflection.v1alpha).
//
// Health: the overall status ("") is SERVING once started. Services register their own names
// with SetServing(name, ...) (unknown names answer NOT_FOUND); a service that is not ready
// (transport missing, draining) sets itself NOT_SERVING. Shutdown turns everything
// NOT_SERVING (open Watch streams see it) and stops accepting at once, so a graceful drain
// (Kubernetes preStop) is SetServing("", false), a probe period's wait, then Shutdown.
//
// Shutdown order (STYLE.md): stop accepting -> let calls in flight finish until the deadline
// -> cancel the rest -> return. Callback reactors must react to OnCancel by finishing, or
// Shutdown waits for them.

#include <grpcpp/impl/service_type.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace preft::rpc {

struct ServerOptions {
  // host:port; port 0 picks a free one (tests use "127.0.0.1:0").
  std::string address = "127.0.0.1:0";
  // Services to serve, borrowed: they must outlive the server. Sync or callback; at least
  // one (the health service is added to them).
  std::vector<grpc::Service*> services;
  // Larger messages are refused with RESOURCE_EXHAUSTED (gRPC's default receive limit is
  // 4 MiB). UpdateAdapter streams weights in chunks well below this.
  int max_receive_message_bytes = 16 << 20;
  int max_send_message_bytes = 16 << 20;
  // TLS or mutual TLS (MakeServerCredentials); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

// Thread-safe. Destruction shuts down with no grace period if Shutdown was not called.
class Server {
 public:
  // Binds and starts. InvalidArgument for an address without a port, no service, a null
  // service or a size limit <= 0; Unavailable, naming the address, when it cannot be bound
  // (in use, not local, malformed) or a service is given twice.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);

  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound port (the chosen one when the address asked for port 0).
  int port() const { return port_; }
  // The address with the bound port, e.g. "127.0.0.1:45123"; what a local client dials.
  const std::string& address() const { return address_; }

  // Sets the health status answered for `service` (a fully qualified service name such as
  // "preft.v1.Preft"; "" is the server as a whole). Ignored after Shutdown.
  void SetServing(const std::string& service, bool serving);

  // Stops accepting calls, waits up to `grace` for calls in flight, cancels the rest and
  // returns once every call has ended. Idempotent: a concurrent or later call returns once
  // the first has finished. InfiniteDuration() never cancels. Never call it from a gRPC
  // callback or reactor of this server: it waits for them.
  void Shutdown(absl::Duration grace);

  // The underlying server, for in-process channels (InProcessChannel) in tests and the
  // embedded cluster.
  grpc::Server* grpc_server() { return server_.get(); }
  // A channel to this server within the process (the HTTP front door's), without gRPC's own
  // retries: callers retry themselves, and retry state costs every open call memory.
  std::shared_ptr<grpc::Channel> InProcessChannel();

 private:
  Server(std::unique_ptr<grpc::Server> server, int port, std::string address);

  std::unique_ptr<grpc::Server> server_;
  const int port_;
  const std::string address_;
  absl::Mutex mu_;
  bool shutdown_started_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;  // Shutdown has returned (concurrent callers wait)
};

}  // namespace preft::rpc

#pragma once

// A process's Prometheus registry and its `GET /metrics` endpoint, the same in every preft
// service. Metric names follow vLLM's where one exists, with the `preft:` prefix; label sets
// stay bounded (never an adapter or request id on a histogram).
//
// Served by cpp-httplib, not prometheus-cpp's civetweb exposer: Debian's civetweb gives its
// threads a fixed 100 KiB stack, and glibc carves each thread's static TLS (OpenBLAS alone has
// 60 KiB) out of it, so the exposer's first scrape overflowed the stack in any process that
// links OpenBLAS.

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}

namespace preft::metrics {

class MetricsServer {
 public:
  // Serves on `address` (host:port; port 0 picks one). InvalidArgument for a malformed address,
  // Unavailable (naming it) when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address);
  // Stops serving and joins the server thread.
  ~MetricsServer();

  prometheus::Registry& registry() { return *registry_; }
  // host:port actually bound.
  const std::string& address() const { return address_; }

 private:
  MetricsServer();
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string address_;
};

}  // namespace preft::metrics

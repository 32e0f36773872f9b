#include "common/metrics/metrics_server.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/http/bind.h"
#include "prometheus/text_serializer.h"

namespace preft::metrics {

MetricsServer::MetricsServer()
    : registry_(std::make_shared<prometheus::Registry>()),
      server_(std::make_unique<httplib::Server>()) {}

MetricsServer::~MetricsServer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  prometheus::Registry* registry = s->registry_.get();
  s->server_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(registry->Collect()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  absl::StatusOr<std::string> bound = http::Bind(*s->server_, address);
  if (!bound.ok())
    return absl::Status(bound.status().code(), absl::StrCat("metrics ", bound.status().message()));
  s->address_ = *std::move(bound);
  httplib::Server* server = s->server_.get();
  auto ended = std::make_shared<std::atomic<bool>>(false);
  s->thread_ = std::thread([server, ended] {
    server->listen_after_bind();
    ended->store(true);
  });
  // httplib's stop() does nothing until listen has begun: a server destroyed right after Start
  // (a worker whose engine then failed to load, a test) left its thread in accept() for good,
  // and the destructor's join with it. Return once it listens (or has already ended).
  while (!server->is_running() && !ended->load()) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return s;
}

}  // namespace preft::metrics

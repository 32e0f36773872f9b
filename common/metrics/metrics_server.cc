#include "common/metrics/metrics_server.h"

#include <httplib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  const std::string host = address.substr(0, colon);
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  prometheus::Registry* registry = s->registry_.get();
  s->server_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(registry->Collect()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  const int bound = port == 0 ? s->server_->bind_to_any_port(host)
                              : (s->server_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  }
  s->address_ = absl::StrCat(host, ":", bound);
  httplib::Server* server = s->server_.get();
  s->thread_ = std::thread([server] { server->listen_after_bind(); });
  return s;
}

}  // namespace preft::metrics

// preft-router: the cluster's public gRPC API in front of prefill and decode workers (or, with
// --colocated, of decode workers that run whole requests).

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/base/termination_signal.h"
#include "common/log/log.h"
#include "common/metrics/metrics_server.h"
#include "common/model/config.h"
#include "common/rpc/server.h"
#include "common/rpc/tls.h"
#include "common/text/tokenizer.h"
#include "services/router/openai_server.h"
#include "services/router/router_service.h"

namespace {

std::vector<std::string> SplitList(const std::vector<std::string>& flags) {
  std::vector<std::string> out;
  for (const std::string& f : flags)
    for (absl::string_view s : absl::StrSplit(f, ',', absl::SkipEmpty())) out.emplace_back(s);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace preft;
  CLI::App app{"preft-router: public gRPC API, placement and adapter admin for a preft cluster"};
  std::string model_dir, listen = "127.0.0.1:0", metrics_listen, http_listen, adapter_root,
      base_name;
  std::vector<std::string> prefill, decode;
  int64_t lease_ms = 30000, poll_ms = 100, max_rank = 128, max_prompt_tokens = 0;
  int max_streams_per_client = 0, max_request_bytes = 16 << 20;
  std::string admin_token_file, api_token_file;
  rpc::TlsFiles tls;
  rpc::AddTlsFlags(app, &tls);
  double admission_timeout_s = 30, drain_timeout_s = 30, kv_path_suspect_s = 30;
  double drain_min_s = 1;
  http::EventServerOptions http_options;
  double http_header_timeout_s = 10, http_idle_timeout_s = 30;
  app.add_option("--model", model_dir, "base model folder (config.json, tokenizer.json)")->required();
  app.add_option("--listen", listen, "host:port to serve on (port 0 picks one)");
  app.add_option("--http-listen", http_listen, "OpenAI-compatible HTTP on host:port (/v1/completions, /v1/chat/completions, /v1/models, /health)");
  app.add_option("--http-max-connections", http_options.max_connections,
                 "open HTTP connections in all; past the cap only /health is served")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--http-max-connections-per-client", http_options.max_connections_per_client,
                 "open HTTP connections per client address; past it only /health is served")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--http-header-timeout-s", http_header_timeout_s,
                 "an HTTP client has this long from connecting to the end of its headers")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--http-idle-timeout-s", http_idle_timeout_s,
                 "a kept-alive HTTP connection closes after this long without a request")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--metrics-listen", metrics_listen, "serve Prometheus metrics on host:port (GET /metrics); none if unset");
  bool colocated = false;
  app.add_option("--prefill", prefill, "prefill workers: host:port or dns:NAME:PORT (repeatable, comma-separated); required unless --colocated");
  app.add_flag("--colocated", colocated, "no prefill tier: send whole requests to decode workers started with --colocated (one engine runs prompt and decode)");
  app.add_option("--decode", decode, "decode workers: host:port or dns:NAME:PORT (repeatable, comma-separated)")->required();
  app.add_option("--adapter-root", adapter_root, "folder adapters are registered from (shared with the workers)");
  std::string registry_url = "file";
  app.add_option("--registry", registry_url,
                 "where registrations and versions live, shared by every router: file (in the "
                 "adapter root) or a postgresql:// URI (password from ~/.pgpass or PGPASSWORD)")
      ->capture_default_str();
  app.add_option("--base-name", base_name, "the base model's name in requests (default: the model folder's name)");
  app.add_option("--max-rank", max_rank, "highest adapter rank accepted")->check(CLI::PositiveNumber);
  app.add_option("--lease-ms", lease_ms, "KV reservation lease")->check(CLI::PositiveNumber);
  app.add_option("--poll-ms", poll_ms, "worker status poll interval")->check(CLI::PositiveNumber);
  app.add_option("--admission-timeout-s", admission_timeout_s, "wait for capacity when the client sets no deadline");
  app.add_option("--drain-timeout-s", drain_timeout_s, "on SIGTERM, wait this long for running requests");
  app.add_option("--drain-min-s", drain_min_s,
                 "on SIGTERM, answer new calls UNAVAILABLE (draining) for at least this long "
                 "before the server shuts down, so clients retry elsewhere instead of seeing "
                 "CANCELLED")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--kv-path-suspect-s", kv_path_suspect_s, "after a prefill worker could not deliver KV to a decode worker, use that decode worker only as a last resort for this long")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--admin-token-file", admin_token_file, "adapter admin RPCs need 'authorization: Bearer <this file's token>'");
  app.add_option("--api-token-file", api_token_file, "every other RPC needs 'authorization: Bearer <this file's token>' (or the admin token)");
  app.add_option("--max-streams-per-client", max_streams_per_client, "concurrent Generate streams per client (TLS identity, token or IP); 0: no cap")->check(CLI::NonNegativeNumber);
  app.add_option("--max-prompt-tokens", max_prompt_tokens, "longer prompts are refused; 0: the model's context")->check(CLI::NonNegativeNumber);
  int relay_threads = router::WorkerPoolOptions{}.relay_threads;
  app.add_option("--relay-threads", relay_threads,
                 "threads relaying decode workers' tokens to clients, below the router's other "
                 "threads in priority (so a new request's admission and first token do not queue "
                 "behind other streams' tokens); 0: relay on gRPC's callback threads")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-request-bytes", max_request_bytes, "larger request messages are refused (RESOURCE_EXHAUSTED)")->check(CLI::PositiveNumber)->capture_default_str();
  // Debian's Abseil checks every Mutex acquisition for deadlock cycles (a graph update per
  // lock: 2-3% of the router's CPU at 5,000 streams). The tests keep the check; the services
  // run without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  log::Options log_options;
  log_options.service = "preft-router";
  log::AddFlags(app, &log_options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  log::Init(log_options);
  const std::vector<std::string> prefill_workers = SplitList(prefill);
  if (colocated && !prefill_workers.empty()) {
    log::Error("--colocated runs whole requests on the decode workers: give no --prefill workers "
               "(got {})",
               absl::StrJoin(prefill_workers, ","));
    return 2;
  }
  if (!colocated && prefill_workers.empty()) {
    log::Error("--prefill is required (or --colocated, without a prefill tier)");
    return 2;
  }
  base::InstallTerminationHandler();
  auto server_credentials = rpc::MakeServerCredentials(tls);
  auto channel_credentials = rpc::MakeChannelCredentials(tls);
  for (const absl::Status& s : {server_credentials.status(), channel_credentials.status()}) {
    if (!s.ok()) {
      log::Error("{}", s);
      return 2;
    }
  }

  auto config = model::ModelConfig::FromFile(model_dir + "/config.json");
  if (!config.ok()) {
    log::Error("{}", config.status());
    return 1;
  }
  std::unique_ptr<text::Tokenizer> tokenizer;
  if (std::filesystem::exists(model_dir + "/tokenizer.json")) {
    auto t = text::Tokenizer::LoadFromModelDir(model_dir);
    if (!t.ok()) {
      log::Error("{}", t.status());
      return 1;
    }
    tokenizer = std::move(t).value();
  }
  if (base_name.empty()) base_name = std::filesystem::path(model_dir).filename().string();
  if (base_name.empty()) base_name = "base";

  router::WorkerPoolOptions pool_options;
  pool_options.prefill = prefill_workers;
  pool_options.decode = SplitList(decode);
  pool_options.poll_interval = absl::Milliseconds(poll_ms);
  pool_options.relay_threads = relay_threads;
  pool_options.credentials = *channel_credentials;
  for (const auto* specs : {&pool_options.prefill, &pool_options.decode}) {
    for (const auto& spec : *specs) {  // malformed is a usage error; unresolvable may heal
      if (auto r = router::ResolveSpec(spec);
          !r.ok() && r.status().code() == absl::StatusCode::kInvalidArgument) {
        log::Error("{}", r.status());
        return 2;
      }
    }
  }
  router::WorkerPool pool(pool_options);
  adapters::LoadOptions load;
  load.max_rank = max_rank;
  absl::StatusOr<std::unique_ptr<router::RegistryStore>> store =
      router::OpenRegistryStore(registry_url, adapter_root);
  if (!store.ok()) {
    log::Error("--registry: {}", store.status());
    return store.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  router::AdapterRegistry registry(*config, base_name, adapter_root, load, *std::move(store));
  router::RouterOptions options;
  options.base_name = base_name;
  options.base_dtype = absl::AsciiStrToLower(kernels::DTypeName(config->torch_dtype));
  options.lease = absl::Milliseconds(lease_ms);
  options.admission_timeout = absl::Seconds(admission_timeout_s);
  options.kv_path_suspect = absl::Seconds(kv_path_suspect_s);
  options.max_prompt_tokens = max_prompt_tokens;
  options.colocated = colocated;
  options.access.max_streams_per_client = max_streams_per_client;
  for (auto [file, token] : {std::pair{&admin_token_file, &options.access.admin_token},
                             std::pair{&api_token_file, &options.access.api_token}}) {
    if (file->empty()) continue;
    absl::StatusOr<std::string> t = router::ReadTokenFile(*file);
    if (!t.ok()) {
      log::Error("{}", t.status());
      return 2;
    }
    *token = *std::move(t);
  }
  std::unique_ptr<metrics::MetricsServer> metrics;
  if (!metrics_listen.empty()) {
    auto m = metrics::MetricsServer::Start(metrics_listen);
    if (!m.ok()) {
      log::Error("--metrics-listen: {}", m.status());
      return 1;
    }
    metrics = std::move(m).value();
    options.metrics = &metrics->registry();
    std::printf("preft-router metrics on http://%s/metrics\n", metrics->address().c_str());
  }
  router::RouterService service(*config, tokenizer.get(), &pool, &registry, options);

  rpc::ServerOptions server_options;
  server_options.address = listen;
  server_options.credentials = *server_credentials;
  server_options.max_receive_message_bytes = max_request_bytes;
  server_options.services = {&service};
  auto server = rpc::Server::Start(server_options);
  if (!server.ok()) {
    log::Error("{}", server.status());
    return 1;
  }
  std::unique_ptr<router::OpenAiServer> http;
  if (!http_listen.empty()) {
    router::OpenAiServerOptions h;
    h.http = http_options;
    h.http.address = http_listen;
    h.http.header_timeout = absl::Seconds(http_header_timeout_s);
    h.http.idle_timeout = absl::Seconds(http_idle_timeout_s);
    h.http.max_body_bytes = max_request_bytes;
    h.router = (*server)->InProcessChannel();
    h.generate = &service;
    h.tokenizer = tokenizer.get();
    auto chat = router::ChatRendererFor(model_dir);
    if (!chat.ok()) {
      log::Error("{}", chat.status());
      return 1;
    }
    h.render_chat = *std::move(chat);
    auto started = router::OpenAiServer::Start(std::move(h));
    if (!started.ok()) {
      log::Error("--http-listen: {}", started.status());
      return 1;
    }
    http = *std::move(started);
    std::printf("preft-router OpenAI HTTP on http://%s/v1\n", http->address().c_str());
  }
  std::printf("preft-router listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);

  const int sig = base::WaitForTerminationSignal();
  log::Info("signal {}, draining", sig);
  service.StartDrain();
  (*server)->SetServing("", false);
  const absl::Time until = absl::Now() + absl::Seconds(drain_timeout_s);
  const absl::Time at_least = absl::Now() + absl::Seconds(std::min(drain_min_s, drain_timeout_s));
  // No new HTTP connections; responses in progress (router calls, which the drain lets
  // finish) end within the drain window, then the rest are cancelled.
  if (http != nullptr) http->Stop(absl::Seconds(drain_timeout_s));
  while ((service.active_requests() > 0 && absl::Now() < until) || absl::Now() < at_least) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  http.reset();
  (*server)->Shutdown(absl::Seconds(5));
  return 0;
}

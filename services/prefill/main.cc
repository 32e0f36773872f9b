// preft-prefill: one prefill worker (DESIGN.md §4) serving preft.worker.v1.PrefillWorker.
//
// Prints `preft-prefill listening on ADDR transport=NAME device=DEVICE` once ready (scripts
// wait for it).
// SIGTERM/SIGINT drain: new prompts are refused, health turns NOT_SERVING, prompts in flight
// finish (up to --drain-timeout-s), then the server shuts down. Exit codes: 0 after a drain,
// 2 for bad flags, 1 when the model, transport or server cannot start.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/termination_signal.h"
#include "common/engine/engine.h"
#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"
#include "services/prefill/prefill_service.h"
#include "services/wire/grpc_kv_transport.h"

namespace {

struct Flags : preft::serving::WorkerFlags {
  preft::serving::AdapterStoreFlags adapters;
};

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "preft-prefill: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

int Run(const Flags& f) {
  using namespace preft;
  // TLS files first: a typo fails before minutes of weight loading.
  auto server_credentials = rpc::MakeServerCredentials(f.tls);
  if (!server_credentials.ok()) return Fail("TLS", server_credentials.status());
  auto channel_credentials = rpc::MakeChannelCredentials(f.tls);
  if (!channel_credentials.ok()) return Fail("TLS", channel_credentials.status());
  absl::StatusOr<serving::WorkerEngine> worker =
      serving::MakeWorkerEngine(f, /*kv_transport=*/true);
  if (!worker.ok()) return Fail("cannot start", worker.status());
  std::unique_ptr<engine::Engine>& engine = worker->engine;

  absl::StatusOr<std::unique_ptr<transport::KvTransport>> transport =
      preft::wire::MakeWorkerTransport(f.transport, *channel_credentials,
                                       engine->backend().device_cache());
  if (!transport.ok()) return Fail("cannot create the transport", transport.status());
  const transport::KvLayout layout = serving::LayoutFor(*engine, worker->model.fingerprint);

  prefill::PrefillServiceOptions options;
  options.adapter_root = f.adapters.root;
  options.store = serving::StoreOptions(f.adapters, worker->model.model->weight_dtype());
  if (worker->metrics != nullptr) options.metrics = &worker->metrics->registry();
  const std::string device = engine->backend().description();
  absl::StatusOr<std::unique_ptr<prefill::PrefillService>> service =
      prefill::PrefillService::Create(std::move(engine), std::move(transport).value(),
                                      layout, options);
  if (!service.ok()) return Fail("cannot start the prefill service", service.status());

  rpc::ServerOptions server_options;
  server_options.address = f.listen;
  server_options.credentials = *server_credentials;
  server_options.services = {service->get()};
  absl::StatusOr<std::unique_ptr<rpc::Server>> server = rpc::Server::Start(server_options);
  if (!server.ok()) return Fail("cannot serve on --listen " + f.listen, server.status());
  if (worker->metrics != nullptr) {
    std::printf("preft-prefill metrics on http://%s/metrics\n", worker->metrics->address().c_str());
  }
  const std::string service_name = worker::v1::PrefillWorker::service_full_name();
  // Ready only on the transport configured (a silent fallback, e.g. to TCP, is refused).
  const absl::Status transport_ok =
      serving::CheckTransport((*service)->endpoint().transport(), f.transport);
  if (!transport_ok.ok()) {
    std::fprintf(stderr, "preft-prefill: %s\n", transport_ok.ToString().c_str());
    (*server)->SetServing("", false);
  }
  (*server)->SetServing(service_name, transport_ok.ok());

  std::printf("preft-prefill listening on %s transport=%s device=%s\n",
              (*server)->address().c_str(), (*service)->endpoint().transport().c_str(),
              device.c_str());
  std::fflush(stdout);

  const int sig = base::WaitForTerminationSignal();
  std::fprintf(stderr, "preft-prefill: signal %d, draining\n", sig);
  (*service)->StartDrain();
  (*server)->SetServing(service_name, false);
  (*server)->SetServing("", false);
  const absl::Time deadline = absl::Now() + absl::Seconds(f.drain_timeout_s);
  const absl::Time at_least = absl::Now() + absl::Seconds(std::min(f.drain_min_s, f.drain_timeout_s));
  while (((*service)->active_requests() > 0 && absl::Now() < deadline) || absl::Now() < at_least) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if ((*service)->active_requests() > 0) {
    std::fprintf(stderr, "preft-prefill: drain timed out with %lld requests in flight\n",
                 static_cast<long long>((*service)->active_requests()));
  }
  (*server)->Shutdown(absl::Seconds(5));
  service->reset();  // stops the engine, then the transport
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  preft::serving::UsePassiveOpenMpWaits(argv);
  // Before any thread starts, so every thread inherits the mask and sigwait sees the signal.
  preft::base::InstallTerminationHandler();
  CLI::App app{
      "preft-prefill: a prefill worker (runs prompts with adapters, pushes their KV "
      "to decode workers)"};
  Flags f;
  preft::serving::AddWorkerFlags(app, &f);
  preft::serving::AddAdapterStoreFlags(app, &f.adapters);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // CLI11 prints the message; --help exits 0
  }
  return Run(f);
}

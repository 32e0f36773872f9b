// preft-prefill: one prefill worker (DESIGN.md §4) serving preft.worker.v1.PrefillWorker.
//
// Prints `preft-prefill listening on ADDR transport=NAME device=DEVICE kv=DTYPE` once ready (scripts
// wait for it).
// SIGTERM/SIGINT drain: new prompts are refused, health turns NOT_SERVING, prompts in flight
// finish (up to --drain-timeout-s), then the server shuts down. Exit codes: 0 after a drain,
// 2 for bad flags, 1 when the model, transport or server cannot start.

#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "common/base/termination_signal.h"
#include "common/engine/engine.h"
#include "common/log/log.h"
#include "common/rpc/server.h"
#include "common/serving/worker_lifecycle.h"
#include "common/serving/worker_setup.h"
#include "services/prefill/prefill_service.h"
#include "services/wire/grpc_kv_transport.h"

namespace {

struct Flags : preft::serving::WorkerFlags {
  preft::serving::AdapterStoreFlags adapters;
};

int Fail(const std::string& what, const absl::Status& status) {
  preft::log::Error("{}: {}", what, status);
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
  prefill::PrefillService* prefill = service->get();
  serving::ServeUntilSignal(
      **server, f,
      {"preft-prefill", service_name, prefill->endpoint().transport(), device,
       [prefill] { prefill->StartDrain(); }, [prefill] { return prefill->active_requests(); },
       "requests", layout.dtype});
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
  // Debian's Abseil checks every Mutex acquisition for deadlock cycles (a graph update per
  // lock: 2-3% of the router's CPU at 5,000 streams). The tests keep the check; the services
  // run without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  preft::log::Options log_options;
  log_options.service = "preft-prefill";
  preft::log::AddFlags(app, &log_options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // CLI11 prints the message; --help exits 0
  }
  preft::log::Init(log_options);
  return Run(f);
}

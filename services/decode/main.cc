// preft-decode: the decode tier as its own process (DESIGN.md §4), or with --colocated a
// worker that runs whole requests (prompt and decode in one engine). Prints
// "preft-decode listening on ADDR transport=NAME device=DEVICE kv=DTYPE" once it serves;
// SIGTERM/SIGINT drain it (Reserve refused, started streams finish, up to
// --drain-timeout-s) and exit 0.

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/termination_signal.h"
#include "common/engine/engine.h"
#include "common/log/log.h"
#include "common/rpc/server.h"
#include "common/serving/worker_lifecycle.h"
#include "common/serving/worker_setup.h"
#include "services/decode/decode_metrics.h"
#include "services/decode/decode_service.h"
#include "services/wire/grpc_kv_transport.h"

namespace {

struct Flags : preft::serving::WorkerFlags {
  std::string advertise_address;  // "grpc" transport: where prefill workers reach this one
  int64_t lease_ms = 10000;
  int64_t quarantine_ms = 2000;
  bool all_position_adapters = false;
  bool colocated = false;
  preft::serving::AdapterStoreFlags adapters;
};

int Fail(const std::string& message) {
  preft::log::Error("{}", message);
  return 1;
}

int Run(const Flags& f) {
  // TLS files first: a typo fails before minutes of weight loading.
  auto server_credentials = preft::rpc::MakeServerCredentials(f.tls);
  if (!server_credentials.ok()) return Fail(std::string(server_credentials.status().message()));
  auto worker = preft::serving::MakeWorkerEngine(f, /*kv_transport=*/!f.colocated);
  if (!worker.ok()) return Fail(std::string(worker.status().message()));
  auto& loaded = worker->model;
  auto& engine = worker->engine;
  auto transport =
      preft::wire::MakeWorkerTransport(f.transport, nullptr, engine->backend().device_cache());
  if (!transport.ok()) return Fail(std::string(transport.status().message()));
  const preft::transport::KvLayout layout =
      preft::serving::LayoutFor(*engine, loaded.fingerprint);

  preft::decode::DecodeServiceOptions so;
  so.default_lease = absl::Milliseconds(f.lease_ms);
  so.max_lease = std::max(so.max_lease, so.default_lease);
  so.quarantine = absl::Milliseconds(f.quarantine_ms);
  so.all_position_adapters = f.all_position_adapters;
  so.colocated = f.colocated;
  so.adapter_root = f.adapters.root;
  so.store = preft::serving::StoreOptions(f.adapters, loaded.model->weight_dtype());
  const std::string device = engine->backend().description();
  auto service =
      preft::decode::DecodeService::Create(std::move(engine), std::move(*transport), layout, so);
  if (!service.ok()) return Fail(std::string(service.status().message()));

  preft::rpc::ServerOptions ro;
  ro.address = f.listen;
  ro.credentials = *server_credentials;
  ro.services = {service->get()};
  auto server = preft::rpc::Server::Start(ro);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  const std::string kServiceName = "preft.worker.v1.DecodeWorker";
  std::unique_ptr<preft::decode::DecodeMetrics> decode_metrics;
  if (worker->metrics != nullptr) {
    decode_metrics = std::make_unique<preft::decode::DecodeMetrics>(worker->metrics->registry(),
                                                                    service->get());
    std::printf("preft-decode metrics on http://%s/metrics\n", worker->metrics->address().c_str());
  }
  (*service)->SetAdvertisedAddress(f.advertise_address.empty() ? (*server)->address()
                                                                : f.advertise_address);
  preft::decode::DecodeService* decode = service->get();
  preft::serving::ServeUntilSignal(
      **server, f,
      {"preft-decode", kServiceName, decode->endpoint().transport(), device,
       [decode] { decode->StartDrain(); }, [decode] { return decode->active_streams(); },
       "streams", layout.dtype});
  server->reset();
  decode_metrics.reset();  // reads the service
  service->reset();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  preft::serving::UsePassiveOpenMpWaits(argv);
  // Before any thread starts, so every thread inherits the mask and sigwait gets the signal.
  preft::base::InstallTerminationHandler();
  Flags f;
  CLI::App app{
      "preft-decode: the decode tier of a preft cluster (KV reservations, base-model decode)"};
  preft::serving::AddWorkerFlags(app, &f);
  app.add_option("--advertise-address", f.advertise_address,
                 "host:port prefill workers dial for the grpc KV transport (default: --listen)");
  app.add_option("--lease-ms", f.lease_ms, "default reservation lease in milliseconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--quarantine-ms", f.quarantine_ms,
                 "how long aborted reservations' blocks stay unusable, in milliseconds")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::string adapters = "none";
  CLI::Option* adapters_option =
      app.add_option("--adapters", adapters,
                     "none (PreFT: decode never loads an adapter) or all-positions (the "
                     "multi-LoRA baseline: each request's adapter also runs on generated tokens)")
          ->capture_default_str()
          ->check(CLI::IsMember({"none", "all-positions"}));
  app.add_flag("--colocated", f.colocated,
               "run whole requests (Run from a router started with --colocated): the prompt with "
               "its adapter, then decode, in this worker's one engine; Reserve is refused and the "
               "KV stays in process (--transport inproc)")
      ->excludes(adapters_option);
  // With --adapters all-positions or --colocated.
  preft::serving::AddAdapterStoreFlags(app, &f.adapters);
  // Debian's Abseil checks every Mutex acquisition for deadlock cycles (a graph update per
  // lock: 2-3% of the router's CPU at 5,000 streams). The tests keep the check; the services
  // run without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  preft::log::Options log_options;
  log_options.service = "preft-decode";
  preft::log::AddFlags(app, &log_options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message; every usage error exits 2, --help exits 0.
    return app.exit(e) == 0 ? 0 : 2;
  }
  preft::log::Init(log_options);
  f.all_position_adapters = adapters == "all-positions";
  if (f.all_position_adapters && f.adapters.root.empty()) {
    preft::log::Error("--adapters all-positions needs --adapter-root");
    return 2;
  }
  if (f.colocated) {
    // A colocated worker moves no KV between processes: a UCX or gRPC transport would only
    // sit idle (and a UCX one holds a worker and its endpoints), so it runs in-process.
    if (app.count("--transport") > 0 && f.transport.kind != "inproc") {
      preft::log::Error(
          "--colocated moves no KV between processes: leave out --transport (or give inproc), "
          "not {}",
          f.transport.kind);
      return 2;
    }
    f.transport.kind = "inproc";
  }
  if (f.colocated && f.adapters.root.empty()) {
    preft::log::Error(
        "--colocated needs --adapter-root (the folder the router registers adapters from)");
    return 2;
  }
  return Run(f);
}

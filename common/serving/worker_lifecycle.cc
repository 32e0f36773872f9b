#include "common/serving/worker_lifecycle.h"

#include <algorithm>
#include <cstdio>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/termination_signal.h"
#include "common/log/log.h"

namespace preft::serving {

int ServeUntilSignal(rpc::Server& server, const WorkerFlags& flags, const WorkerServing& w) {
  const absl::Status transport_ok = CheckTransport(w.transport, flags.transport);
  if (!transport_ok.ok()) {
    log::Error("{}", transport_ok);
    server.SetServing("", false);
  }
  server.SetServing(w.service_name, transport_ok.ok());
  std::printf("%s listening on %s transport=%s device=%s kv=%s\n", w.process.c_str(),
              server.address().c_str(), w.transport.c_str(), w.device.c_str(),
              w.kv_dtype.c_str());
  std::fflush(stdout);

  const int sig = base::WaitForTerminationSignal();
  log::Info("signal {}, draining", sig);
  w.start_drain();
  server.SetServing(w.service_name, false);
  server.SetServing("", false);
  const absl::Time deadline = absl::Now() + absl::Seconds(flags.drain_timeout_s);
  const absl::Time at_least =
      absl::Now() + absl::Seconds(std::min(flags.drain_min_s, flags.drain_timeout_s));
  while ((w.in_flight() > 0 && absl::Now() < deadline) || absl::Now() < at_least) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (const int64_t open = w.in_flight(); open > 0) {
    log::Warn("drain timed out with {} {} in flight", open, w.in_flight_what);
  }
  server.Shutdown(absl::Seconds(5));
  return sig;
}

}  // namespace preft::serving

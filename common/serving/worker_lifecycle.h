#pragma once

// The end of every worker's main (preft-prefill, preft-decode): ready on the transport it was
// asked for, then on SIGTERM or SIGINT a drain that routers can see, then shutdown.

#include <cstdint>
#include <functional>
#include <string>

#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"

namespace preft::serving {

struct WorkerServing {
  std::string process;       // "preft-prefill": names the process on its lines
  std::string service_name;  // the gRPC service whose health says "ready"
  std::string transport;     // the KV transport the service ended up on
  std::string device;        // where its forward runs (ForwardBackend::description)
  std::function<void()> start_drain;    // new calls answered UNAVAILABLE "draining"
  std::function<int64_t()> in_flight;   // calls or streams still open
  std::string in_flight_what;           // "requests", "streams"
  std::string kv_dtype;                 // how its KV cache stores K and V (KvLayout::dtype)
};

// Marks `server` SERVING only when `w.transport` is the one `flags` asked for (a silent
// fallback, to TCP say, is refused and logged), prints "<process> listening on <address>
// transport=... device=... kv=..." on stdout (scripts wait for it), and waits for a termination
// signal. Then drains: health NOT_SERVING, calls refused for at least flags.drain_min_s and
// until nothing is in flight or flags.drain_timeout_s has passed; then shuts the server down
// (5 s for calls still open). Returns the signal's number.
int ServeUntilSignal(rpc::Server& server, const WorkerFlags& flags, const WorkerServing& w);

}  // namespace preft::serving

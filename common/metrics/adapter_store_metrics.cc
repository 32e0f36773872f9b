#include "common/metrics/adapter_store_metrics.h"

#include "common/metrics/families.h"

namespace preft::metrics {
namespace {

// Moves c on by what the store counted since the last reading, in c's unit (`unit` of the
// store's count each).
void Advance(prometheus::Counter& c, int64_t now, int64_t before, double unit = 1.0) {
  if (now > before) c.Increment(unit * static_cast<double>(now - before));
}

}  // namespace

AdapterStoreMetrics::State AdapterStoreMetrics::Read(
    const adapters::AdapterStore& store, const adapters::AdapterStoreOptions& options,
    const std::vector<adapters::AdapterInfo>& listed) {
  State s;
  s.stats = store.stats();
  s.compute_capacity_bytes = options.compute_bytes;
  s.host_capacity_bytes = options.host_bytes;
  for (const adapters::AdapterInfo& a : listed) {
    s.in_compute += a.in_compute;
    s.in_host += a.in_host;
  }
  return s;
}

AdapterStoreMetrics::AdapterStoreMetrics(prometheus::Registry& r)
    : versions_(GaugeFamily(r, "preft:adapters",
                            "Adapter versions by state: compute (in a compute slot), host (parsed "
                            "in host memory), pinned (held by running requests).")),
      bytes_(GaugeFamily(r, "preft:adapter_bytes", "Adapter bytes held, by tier (compute, host).")),
      capacity_(GaugeFamily(r, "preft:adapter_capacity_bytes",
                            "Adapter budget, by tier (compute, host).")),
      acquires_(CounterFamily(r, "preft:adapter_acquires_total",
                              "Adapter acquisitions by result: compute_hit (resident), joined (a "
                              "load already under way), host_hit, disk_load, load_failure. Misses "
                              "are all but compute_hit.")),
      evictions_(CounterFamily(r, "preft:adapter_evictions_total",
                               "Adapter copies dropped to make room, by tier (compute, host).")),
      disk_load_seconds_(Counter(r, "preft:adapter_disk_load_seconds_total",
                                 "Time loader threads spent reading adapters from disk; over "
                                 "acquires with result disk_load, one load's cost.")) {}

void AdapterStoreMetrics::Set(const State& s) {
  versions_.Add({{"state", "compute"}}).Set(static_cast<double>(s.in_compute));
  versions_.Add({{"state", "host"}}).Set(static_cast<double>(s.in_host));
  versions_.Add({{"state", "pinned"}}).Set(static_cast<double>(s.stats.pinned));
  bytes_.Add({{"tier", "compute"}}).Set(static_cast<double>(s.stats.compute_bytes_used));
  bytes_.Add({{"tier", "host"}}).Set(static_cast<double>(s.stats.host_bytes_used));
  capacity_.Add({{"tier", "compute"}}).Set(static_cast<double>(s.compute_capacity_bytes));
  capacity_.Add({{"tier", "host"}}).Set(static_cast<double>(s.host_capacity_bytes));
  absl::MutexLock lock(&mu_);
  const adapters::AdapterStoreStats& b = last_;
  const adapters::AdapterStoreStats& n = s.stats;
  Advance(acquires_.Add({{"result", "compute_hit"}}), n.compute_hits, b.compute_hits);
  Advance(acquires_.Add({{"result", "joined"}}), n.joined, b.joined);
  Advance(acquires_.Add({{"result", "host_hit"}}), n.host_hits, b.host_hits);
  Advance(acquires_.Add({{"result", "disk_load"}}), n.disk_loads, b.disk_loads);
  Advance(acquires_.Add({{"result", "load_failure"}}), n.load_failures, b.load_failures);
  Advance(evictions_.Add({{"tier", "compute"}}), n.compute_evictions, b.compute_evictions);
  Advance(evictions_.Add({{"tier", "host"}}), n.host_evictions, b.host_evictions);
  Advance(disk_load_seconds_, n.disk_load_micros, b.disk_load_micros, 1e-6);
  last_ = n;
}

}  // namespace preft::metrics

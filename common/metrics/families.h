#pragma once

// One-line registration of the metrics every service declares: a family and, for the
// unlabelled ones, its single series.

#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace preft::metrics {

inline prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r,
                                                              const std::string& name,
                                                              const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r,
                                                          const std::string& name,
                                                          const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& r,
                                                                  const std::string& name,
                                                                  const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

inline prometheus::Counter& Counter(prometheus::Registry& r, const std::string& name,
                                    const std::string& help) {
  return CounterFamily(r, name, help).Add({});
}
inline prometheus::Gauge& Gauge(prometheus::Registry& r, const std::string& name,
                                const std::string& help) {
  return GaugeFamily(r, name, help).Add({});
}
inline prometheus::Histogram& Histogram(prometheus::Registry& r, const std::string& name,
                                        const std::string& help,
                                        const prometheus::Histogram::BucketBoundaries& buckets) {
  return HistogramFamily(r, name, help).Add({}, buckets);
}

}  // namespace preft::metrics

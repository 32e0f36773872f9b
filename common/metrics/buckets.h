#pragma once

// Histogram buckets shared by every service, vLLM's where it has them, so dashboards and
// alerts written for vLLM read preft's histograms the same way.

#include "prometheus/histogram.h"

namespace preft::metrics {

// Time to first token, and the TTFT split by stage.
inline const prometheus::Histogram::BucketBoundaries& TtftBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
      1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
  return b;
}

// Inter-token latency.
inline const prometheus::Histogram::BucketBoundaries& ItlBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
      0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
  return b;
}

// Whole requests and their phases (end to end, queue, prefill, decode).
inline const prometheus::Histogram::BucketBoundaries& RequestBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
      30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  return b;
}

// Token counts (per request, per step) and batch sizes: 1, 2, 5, 10, 20, 50, ... up to `max`.
inline prometheus::Histogram::BucketBoundaries OneTwoFiveBuckets(double max) {
  prometheus::Histogram::BucketBoundaries b;
  for (double scale = 1;; scale *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * scale > max) return b;
      b.push_back(m * scale);
    }
  }
}

// Sub-millisecond operations: KV transfers, adapter loads, forwards.
inline const prometheus::Histogram::BucketBoundaries& FastBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
  return b;
}

}  // namespace preft::metrics

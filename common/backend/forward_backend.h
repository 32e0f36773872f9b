#pragma once

// Where a forward runs. The engine schedules, samples and streams the same way over any
// backend: the CPU model over a host KV cache (CpuBackend), or with CUDA a DeviceModel over
// device memory (CudaBackend, common/backend/cuda_backend.h).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/aligned_vector.h"
#include "common/kv/kv_cache.h"
#include "common/model/config.h"
#include "common/model/forward_batch.h"

namespace preft::backend {

// How one logit row is sampled, for backends that sample where the logits are (the engine's
// SamplingParams, and the request's seed and step for the counter-based uniform).
struct RowSampling {
  float temperature = 0.f;  // <= 1e-5: greedy
  float top_p = 1.f;
  float min_p = 0.f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  uint64_t step = 0;
};

class ForwardBackend {
 public:
  virtual ~ForwardBackend() = default;

  virtual const model::ModelConfig& config() const = 0;
  // The shape of the backend's paged KV cache (its block count bounds the engine's allocator).
  virtual const kv::KvCacheShape& cache_shape() const = 0;
  // Runs `batch`, writing its K/V into the backend's cache; the logits of batch.logit_rows go
  // to `logits` ([rows, vocab], host memory).
  virtual absl::Status Forward(const model::ForwardBatch& batch, base::AlignedVector<float>* logits) = 0;
  // Backends that can sample where the logits are (a GPU: no logits copied to the host) say
  // so, and ForwardSample runs `batch` and returns only each logit row's token, sampled with
  // rows[r] exactly as the engine's host sampler would. The engine keeps Forward for steps
  // that need the logits themselves (logprobs).
  virtual bool samples_on_device() const { return false; }
  virtual absl::Status ForwardSample(const model::ForwardBatch& batch,
                                     const std::vector<RowSampling>& rows,
                                     std::vector<int32_t>* tokens) {
    return absl::UnimplementedError("this backend samples on the host: call Forward");
  }
  // A request naming `adapter` was queued: a backend that keeps its own copies of adapters
  // (a GPU's) may start copying it now, off the engine thread, so the copy overlaps the steps
  // before its first use. Errors wait for the forward that uses the adapter.
  virtual void PrepareAdapter(const std::shared_ptr<const model::AdapterWeights>& adapter) {}
  // Whether a forward naming `adapter` would run without waiting for its copy to arrive. The
  // engine admits a prompt once its adapter is ready, so a copy in flight delays that request
  // alone, never the sequences already running; starts the preparation if none was started.
  // An error when the adapter cannot be prepared (no device memory for it, say): the engine
  // fails the requests naming it with that error, and only them.
  virtual absl::StatusOr<bool> AdapterReady(const std::shared_ptr<const model::AdapterWeights>& adapter) {
    return true;
  }
  // The dtype adapters are converted to for compute (the form the adapter store keeps).
  virtual kernels::DType adapter_dtype() const = 0;
  // Whether the forward runs adapters through the CPU kernels, which take some matrices in a
  // layout of their own (adapters::LoadOptions::cpu_layout); a GPU backend uploads row-major.
  virtual bool cpu_adapter_kernels() const { return true; }
  // The KV cache in host memory, which the KV transport reads and writes; null when the cache
  // lives on a device and keeps no host mirror.
  virtual kv::KvCache* host_cache() { return nullptr; }
  // The cache in device memory, for a transport that moves device blocks directly (CUDA IPC);
  // a null base where the cache is in host memory.
  virtual kv::DeviceKvView device_cache() const { return {}; }
  // A backend whose cache lives on a device but keeps a host mirror for the KV transport
  // copies blocks (every layer) between the two: the engine copies a prefilled prompt's
  // blocks out before handing them over, and an imported prompt's in before decoding it.
  // Nothing to do where host_cache() is the cache itself.
  virtual absl::Status KvToHost(const std::vector<int32_t>& blocks) { return absl::OkStatus(); }
  virtual absl::Status KvFromHost(const std::vector<int32_t>& blocks) { return absl::OkStatus(); }
  virtual const char* name() const = 0;  // "cpu", "cuda"
  // Where the forward runs, for a worker's startup line: name(), or with tensor parallelism
  // "cuda x4 (nccl)".
  virtual std::string description() const { return name(); }
};

}  // namespace preft::backend

#pragma once

// A CPU backend that shows no host cache, as a GPU worker's does when it keeps no host mirror
// (--device cuda --transport cuda_ipc): what a service must refuse to pair with a transport
// that moves host memory. Tests derive from it for other device-like caches (a host mirror).

#include <memory>
#include <utility>

#include "common/backend/cpu_backend.h"
#include "common/backend/forward_backend.h"

namespace preft::testing {

class CachelessBackend : public backend::ForwardBackend {
 public:
  static std::unique_ptr<CachelessBackend> Create(model::Model* m, int64_t blocks,
                                                  int64_t block_tokens = 16) {
    auto cpu = backend::CpuBackend::Create(m, blocks, block_tokens);
    return cpu.ok() ? std::unique_ptr<CachelessBackend>(new CachelessBackend(*std::move(cpu)))
                    : nullptr;
  }
  explicit CachelessBackend(std::unique_ptr<backend::CpuBackend> cpu) : cpu_(std::move(cpu)) {}
  const model::ModelConfig& config() const override { return cpu_->config(); }
  const kv::KvCacheShape& cache_shape() const override { return cpu_->cache_shape(); }
  absl::Status Forward(const model::ForwardBatch& batch,
                       base::AlignedVector<float>* logits) override {
    return cpu_->Forward(batch, logits);
  }
  kernels::DType adapter_dtype() const override { return cpu_->adapter_dtype(); }
  const char* name() const override { return "device-like"; }

 protected:
  // The cache the forward runs on (the "device" one).
  kv::KvCache& device_kv() { return *cpu_->host_cache(); }

 private:
  std::unique_ptr<backend::CpuBackend> cpu_;
};

}  // namespace preft::testing

#include "common/backend/cuda_backend.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/base/status_rendezvous.h"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kernels/cuda/sampling.cuh"

namespace preft::backend {

namespace cuda = kernels::cuda;

// One thread per rank, on its rank's device for life: every CUDA call of a rank (its model,
// cache, slots and their uploader) comes from there. Run hands all of them one job and waits.
class CudaBackend::RankThreads {
 public:
  explicit RankThreads(const std::vector<int>& devices) : status_(devices.size()) {
    for (size_t r = 0; r < devices.size(); ++r) {
      threads_.emplace_back([this, r, device = devices[r]] { Loop(static_cast<int>(r), device); });
    }
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  absl::Status Run(const std::function<absl::Status(int)>& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &fn;
    done_ = 0;
    ++generation_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return done_ == threads_.size(); });
    job_ = nullptr;
    for (absl::Status& s : status_) {
      if (!s.ok()) return std::exchange(s, absl::OkStatus());
    }
    return absl::OkStatus();
  }

 private:
  void Loop(int rank, int device) {
    const absl::Status on_device =
        cuda::SetDevice(device) == 0
            ? absl::OkStatus()
            : absl::InternalError(absl::StrCat("cannot make GPU ", device, " current"));
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<absl::Status(int)>* job = job_;
      lock.unlock();
      absl::Status s = on_device.ok() ? (*job)(rank) : on_device;
      lock.lock();
      status_[rank] = std::move(s);
      if (++done_ == threads_.size()) cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<absl::Status(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  size_t done_ = 0;
  bool stop_ = false;
  std::vector<absl::Status> status_;
  std::vector<std::thread> threads_;
};

absl::Status CudaBackend::OnRanks(const std::function<absl::Status(int)>& fn) {
  if (threads_ == nullptr) return fn(0);
  return threads_->Run(fn);
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const model::Model& model,
                                                                 const Options& options) {
  return Build(model.config(), options, [&](const TensorShard& shard, cuda::Collective* c) {
    return DeviceModel::Upload(model, shard, c);
  });
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::CreateRandom(const model::ModelConfig& config,
                                                                       uint64_t seed,
                                                                       const Options& options) {
  return Build(config, options, [&](const TensorShard& shard, cuda::Collective* c) {
    return DeviceModel::Random(config, seed, shard, c);
  });
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Build(const model::ModelConfig& config,
                                                                const Options& options,
                                                                const MakeRank& make_rank) {
  const int tp = options.tensor_parallel;
  PREFT_RETURN_IF_ERROR(CheckTensorParallel(config, tp));
  const int visible = cuda::DeviceCount();
  if (visible == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  if (tp > 1 && !options.ranks_share_device && visible < tp) {
    return absl::FailedPreconditionError(absl::StrCat("tensor parallelism over ", tp,
                                                      " GPUs, but ", visible, " visible"));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->ranks_.resize(tp);
  std::vector<int> devices(tp);
  for (int r = 0; r < tp; ++r) devices[r] = options.ranks_share_device ? 0 : r;
  if (tp > 1) {
    std::vector<std::unique_ptr<cuda::Collective>> collectives;
    const std::string error = cuda::MakeCollectives(devices, &collectives);
    if (!error.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("tensor parallelism over ", tp,
                                                        " ranks: ", error));
    }
    for (int r = 0; r < tp; ++r) b->ranks_[r].collective = std::move(collectives[r]);
    b->threads_ = std::make_unique<RankThreads>(devices);
    b->agreement_ = std::make_unique<base::StatusRendezvous>(tp, "tensor-parallel rank");
  }

  // Weights first, then the KV pools sized from what every rank has left.
  std::vector<int64_t> fit(tp, options.kv_blocks);
  const kv::KvCacheShape full_one{config.num_layers,   1,
                                  options.block_tokens, config.num_kv_heads,
                                  config.head_dim,      options.kv_dtype};
  PREFT_RETURN_IF_ERROR(b->OnRanks([&](int r) -> absl::Status {
    Rank& rank = b->ranks_[r];
    PREFT_ASSIGN_OR_RETURN(rank.model, make_rank({r, tp}, rank.collective.get()));
    rank.model->UseGraphs(options.graphs);
    if (b->agreement_ != nullptr) {
      rank.model->SetStepAgreement([agreement = b->agreement_.get(), r](const absl::Status& s) {
        return agreement->Post(r, s);
      });
    }
    rank.slots = std::make_unique<DeviceAdapterSlots>(options.adapter_bytes, TensorShard{r, tp});
    if (fit[r] <= 0) {
      PREFT_ASSIGN_OR_RETURN(
          fit[r], DeviceKvCache::BlocksThatFit(rank.model->CacheShape(1, options.block_tokens,
                                                                       options.kv_dtype),
                                               options.memory_fraction, options.adapter_bytes));
    }
    return absl::OkStatus();
  }));
  int64_t blocks = *std::min_element(fit.begin(), fit.end());
  // Ranks sharing a device each measured all of its free memory.
  if (options.kv_blocks <= 0 && options.ranks_share_device) blocks /= tp;
  if (blocks <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no KV block (", full_one.bytes_per_block_all_layers() / tp,
        " bytes per GPU) fits in device memory"));
  }
  PREFT_RETURN_IF_ERROR(b->OnRanks([&](int r) -> absl::Status {
    Rank& rank = b->ranks_[r];
    PREFT_ASSIGN_OR_RETURN(
        rank.cache, DeviceKvCache::Create(
                       rank.model->CacheShape(blocks, options.block_tokens, options.kv_dtype)));
    return absl::OkStatus();
  }));
  b->shape_ = full_one;
  b->shape_.num_blocks = blocks;
  if (options.host_mirror) {
    absl::StatusOr<std::unique_ptr<kv::KvCache>> mirror = kv::KvCache::Create(b->shape_);
    if (!mirror.ok()) {
      return absl::Status(mirror.status().code(),
                          absl::StrCat("host mirror of the KV cache: ", mirror.status().message()));
    }
    b->mirror_ = *std::move(mirror);
  }
  return b;
}

CudaBackend::~CudaBackend() {
  // Each rank's device objects go on its own thread, with its device current.
  OnRanks([&](int r) {
    Rank& rank = ranks_[r];
    rank.slots.reset();
    rank.cache.reset();
    rank.model.reset();
    rank.collective.reset();
    return absl::OkStatus();
  }).IgnoreError();
}

std::string CudaBackend::description() const {
  if (ranks_.size() == 1) return name();
  return absl::StrCat(name(), " x", ranks_.size(), " (", collective_kind(), ")");
}

const char* CudaBackend::collective_kind() const {
  return ranks_[0].collective != nullptr ? ranks_[0].collective->kind() : "";
}

kv::DeviceKvView CudaBackend::device_cache() const {
  if (ranks_.size() > 1) return {};  // split over the GPUs: not one pool a transport can map
  return {ranks_[0].cache->layer_data(0), ranks_[0].cache->shape()};
}

absl::Status CudaBackend::Forward(const model::ForwardBatch& batch, base::AlignedVector<float>* logits) {
  return OnRanks([&](int r) {
    Rank& rank = ranks_[r];
    return r == 0 ? rank.model->Forward(batch, rank.cache.get(), rank.slots.get(), logits)
                  : rank.model->ForwardRank(batch, rank.cache.get(), rank.slots.get());
  });
}

absl::Status CudaBackend::ForwardSample(const model::ForwardBatch& batch,
                                        const std::vector<RowSampling>& rows,
                                        std::vector<int32_t>* tokens) {
  std::vector<cuda::SampleSpec> specs(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    specs[r] = {rows[r].temperature, rows[r].top_p, rows[r].min_p,
                rows[r].top_k,       rows[r].seed,  rows[r].step};
  }
  return OnRanks([&](int r) {
    Rank& rank = ranks_[r];
    return r == 0
               ? rank.model->ForwardSample(batch, rank.cache.get(), rank.slots.get(), specs, tokens)
               : rank.model->ForwardRank(batch, rank.cache.get(), rank.slots.get());
  });
}

void CudaBackend::PrepareAdapter(const std::shared_ptr<const model::AdapterWeights>& adapter) {
  OnRanks([&](int r) {
    ranks_[r].slots->Prefetch(adapter);
    return absl::OkStatus();
  }).IgnoreError();
}

absl::StatusOr<bool> CudaBackend::AdapterReady(
    const std::shared_ptr<const model::AdapterWeights>& adapter) {
  std::vector<char> ready(ranks_.size(), 0);
  PREFT_RETURN_IF_ERROR(OnRanks([&](int r) -> absl::Status {
    PREFT_ASSIGN_OR_RETURN(const bool on_device, ranks_[r].slots->Ready(adapter));
    ready[r] = on_device;
    return absl::OkStatus();
  }));
  return std::all_of(ready.begin(), ready.end(), [](char c) { return c != 0; });
}

// Each rank moves its own KV heads, into or out of their place in the mirror (disjoint).
absl::Status CudaBackend::KvToHost(const std::vector<int32_t>& blocks) {
  if (mirror_ == nullptr) return absl::OkStatus();
  const int tp = tensor_parallel();
  return OnRanks([&](int r) {
    return ranks_[r].cache->CopyBlocksToHost(blocks, mirror_.get(), {r, tp});
  });
}

absl::Status CudaBackend::KvFromHost(const std::vector<int32_t>& blocks) {
  if (mirror_ == nullptr) return absl::OkStatus();
  const int tp = tensor_parallel();
  return OnRanks([&](int r) {
    return ranks_[r].cache->CopyBlocksFromHost(*mirror_, blocks, {r, tp});
  });
}

}  // namespace preft::backend

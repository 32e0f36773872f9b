#include "common/backend/device_adapters.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kernels/dtype.h"

namespace preft::backend {
namespace {

namespace cuda = kernels::cuda;
using kernels::DType;

}  // namespace

absl::StatusOr<std::unique_ptr<UploadStage>> UploadStage::Create() {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  std::unique_ptr<UploadStage> stage(new UploadStage());
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamCreate(&stage->stream_), "upload stream"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::EventCreate(&stage->copied_), "upload event"));
  return stage;
}

UploadStage::~UploadStage() {
  if (stream_ != nullptr) cuda::StreamSynchronize(stream_);
  if (pinned_ != nullptr) cuda::HostFree(pinned_);
  if (copied_ != nullptr) cuda::EventDestroy(copied_);
  if (stream_ != nullptr) cuda::StreamDestroy(stream_);
}

absl::StatusOr<uint8_t*> UploadStage::Buffer(size_t bytes) {
  // An event never recorded counts as done.
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::EventSynchronize(copied_), "upload"));
  if (bytes > size_) {
    if (pinned_ != nullptr) cuda::HostFree(pinned_);
    pinned_ = nullptr;
    size_ = 0;
    void* p = nullptr;
    // Grown in steps, so adapters of slightly different sizes do not re-pin each time.
    const size_t want = std::max(bytes + bytes / 4, size_t{1} << 20);
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::HostAlloc(&p, want), "page-locked staging"));
    pinned_ = static_cast<uint8_t*>(p);
    size_ = want;
  }
  return pinned_;
}

absl::Status UploadStage::Copy(void* dst, size_t bytes, void* done) {
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(dst, pinned_, bytes, stream_), "upload"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::EventRecord(copied_, stream_), "upload"));
  return CudaStatus(cuda::EventRecord(done, stream_), "upload");
}


DeviceAdapter::~DeviceAdapter() {
  // Freeing data_ waits for the device, so a queued copy into it is finished first.
  data_ = DeviceBuffer();
  if (ready_ != nullptr) cuda::EventDestroy(ready_);
}

// The pair in table entry (layer, slot) of `a`, or null when that entry is unused.
const model::LowRank* PairOf(const model::AdapterWeights& a, int64_t layer, int slot) {
  if (a.kind() == model::AdapterKind::kDireft) {
    return slot == DeviceAdapter::kDireftSlot ? &a.direft(layer) : nullptr;
  }
  return slot < model::kNumProjections ? &a.lora(layer, static_cast<model::Projection>(slot)) : nullptr;
}

namespace {

// The part of the pair in `slot` that rank `shard` holds: LoRA follows its projection's split;
// DiReFT (on the whole residual stream) is replicated.
LowRankSlice SliceOfSlot(const model::LowRank& lr, int slot, const TensorShard& shard) {
  if (slot == DeviceAdapter::kDireftSlot) {
    return {{0, lr.shrink.cols}, {0, lr.expand.cols}, true};
  }
  return SliceOfLowRank(lr, static_cast<model::Projection>(slot), shard);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceAdapter>> DeviceAdapter::Allocate(const model::AdapterWeights& a,
                                                                      const TensorShard& shard) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  const int64_t layers = a.num_layers();
  std::unique_ptr<DeviceAdapter> out(new DeviceAdapter());
  out->placed_.resize(layers * kEntriesPerLayer);
  Placer plan;
  for (int64_t l = 0; l < layers; ++l) {
    for (int slot = 0; slot < kEntriesPerLayer; ++slot) {
      const model::LowRank* lr = PairOf(a, l, slot);
      if (lr == nullptr || lr->empty()) continue;
      if (lr->rank() > cuda::kMaxLowRank) {
        return absl::InvalidArgumentError(absl::StrCat("adapter rank ", lr->rank(),
                                                       " exceeds the CUDA kernels' limit of ",
                                                       cuda::kMaxLowRank));
      }
      if (lr->shrink.dtype != lr->expand.dtype) {
        return absl::InvalidArgumentError("adapter shrink and expand matrices differ in dtype");
      }
      if (lr->shrink.chunked || lr->expand.chunked) {
        return absl::InvalidArgumentError(
            "adapter matrices in the CPU kernels' chunked layout (loaded with "
            "LoadOptions::cpu_layout) cannot be uploaded to a GPU");
      }
      Placed& p = out->placed_[Entry(l, slot)];
      p.slice = SliceOfSlot(*lr, slot, shard);
      const size_t es = kernels::DTypeSize(lr->shrink.dtype);
      p.shrink = plan.Place(lr->rank() * p.slice.shrink_cols.size() * es);
      p.expand = plan.Place(lr->rank() * p.slice.expand_cols.size() * es);
      if (lr->shrink_bias != nullptr && p.slice.bias) {
        p.bias = plan.Place(lr->rank() * sizeof(float));
      }
    }
  }
  out->table_at_ = plan.Place(out->placed_.size() * sizeof(cuda::LowRankPair));
  out->kind_ = a.kind();
  out->max_rank_ = a.max_rank();
  PREFT_ASSIGN_OR_RETURN(out->data_, DeviceBuffer::Allocate(plan.size()));
  out->table_ = out->data_.as<cuda::LowRankPair>(out->table_at_);
  return out;
}

void DeviceAdapter::Fill(const model::AdapterWeights& a, uint8_t* staging) const {
  // Padding between the pieces is never read: it may hold anything.
  auto* table = reinterpret_cast<cuda::LowRankPair*>(staging + table_at_);
  for (int64_t l = 0; l < a.num_layers(); ++l) {
    for (int slot = 0; slot < kEntriesPerLayer; ++slot) {
      const model::LowRank* lr = PairOf(a, l, slot);
      cuda::LowRankPair& pair = table[Entry(l, slot)];
      pair = cuda::LowRankPair{};
      if (lr == nullptr || lr->empty()) continue;
      const Placed& p = placed_[Entry(l, slot)];
      const ShardRange ranks{0, lr->rank()};
      CopySubMatrix(lr->shrink, ranks, p.slice.shrink_cols, staging + p.shrink);
      CopySubMatrix(lr->expand, ranks, p.slice.expand_cols, staging + p.expand);
      const bool bias = lr->shrink_bias != nullptr && p.slice.bias;
      if (bias) std::memcpy(staging + p.bias, lr->shrink_bias, lr->rank() * sizeof(float));
      pair = {data_.as<uint8_t>(p.shrink),       data_.as<uint8_t>(p.expand),
              lr->shrink.dtype,                  lr->rank(),
              p.slice.shrink_cols.size(),        p.slice.expand_cols.size(),
              bias ? data_.as<float>(p.bias) : nullptr, lr->scale};
    }
  }
}

absl::Status DeviceAdapter::Stage(const model::AdapterWeights& a, UploadStage* stage) {
  PREFT_ASSIGN_OR_RETURN(uint8_t* staging, stage->Buffer(data_.size()));
  Fill(a, staging);
  if (ready_ == nullptr) PREFT_RETURN_IF_ERROR(CudaStatus(cuda::EventCreate(&ready_), "upload event"));
  return stage->Copy(data_.get(), data_.size(), ready_);
}

absl::StatusOr<std::unique_ptr<DeviceAdapter>> DeviceAdapter::Random(const model::ModelConfig& c,
                                                                    model::AdapterKind kind,
                                                                    int64_t rank, uint64_t seed) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  if (rank < 1 || rank > cuda::kMaxLowRank) {
    return absl::InvalidArgumentError(absl::StrCat("rank must be in [1, ", cuda::kMaxLowRank,
                                                   "], got ", rank));
  }
  const int64_t layers = c.num_layers;
  std::vector<cuda::LowRankPair> table(layers * kEntriesPerLayer);
  std::vector<size_t> shrink_at(table.size()), expand_at(table.size());
  Placer plan;
  for (int64_t l = 0; l < layers; ++l) {
    for (int slot = 0; slot < kEntriesPerLayer; ++slot) {
      const bool used = kind == model::AdapterKind::kDireft ? slot == kDireftSlot : slot < model::kNumProjections;
      if (!used) continue;
      const auto [in, out] = slot == kDireftSlot
                                 ? model::ProjectionDims{c.hidden_size, c.hidden_size}
                                 : model::DimsOf(c, static_cast<model::Projection>(slot));
      const int64_t e = Entry(l, slot);
      shrink_at[e] = plan.Place(rank * in * sizeof(uint16_t));
      expand_at[e] = plan.Place(rank * out * sizeof(uint16_t));
      table[e] = {nullptr, nullptr, DType::kBF16, rank, in, out, nullptr, 1.f};
    }
  }
  const size_t table_at = plan.Place(table.size() * sizeof(cuda::LowRankPair));
  std::unique_ptr<DeviceAdapter> out(new DeviceAdapter());
  out->kind_ = kind;
  out->max_rank_ = rank;
  PREFT_ASSIGN_OR_RETURN(out->data_, DeviceBuffer::Allocate(plan.size()));
  for (size_t e = 0; e < table.size(); ++e) {
    cuda::LowRankPair& p = table[e];
    if (p.rank == 0) continue;
    auto* s = out->data_.as<uint16_t>(shrink_at[e]);
    auto* x = out->data_.as<uint16_t>(expand_at[e]);
    // Shrink fan-in scaled; the update about 0.3x what it is added to (as make-adapter).
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::FillRandomBf16(s, p.rank * p.in, seed * 1315423911u + 2 * e,
                                                    UniformBound(1.0 / std::sqrt(p.in)), nullptr),
                               "fill"));
    PREFT_RETURN_IF_ERROR(CudaStatus(cuda::FillRandomBf16(x, p.rank * p.out, seed * 1315423911u + 2 * e + 1,
                                                    UniformBound(0.3 / std::sqrt(p.rank)), nullptr),
                               "fill"));
    p.shrink = s;
    p.expand = x;
  }
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToDevice(out->data_.as<uint8_t>(table_at), table.data(),
                                                table.size() * sizeof(table[0]), nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
  out->table_ = out->data_.as<cuda::LowRankPair>(table_at);
  return out;
}

// ---- AdapterUploader ----

absl::StatusOr<std::unique_ptr<AdapterUploader>> AdapterUploader::Create() {
  std::unique_ptr<AdapterUploader> u(new AdapterUploader());
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::GetDevice(&u->device_), "current device"));
  PREFT_ASSIGN_OR_RETURN(u->stage_, UploadStage::Create());
  u->thread_ = std::thread([raw = u.get()] { raw->Run(); });
  return u;
}

AdapterUploader::~AdapterUploader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void AdapterUploader::Enqueue(std::shared_ptr<const model::AdapterWeights> host, DeviceAdapter* dst) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(dst);
    jobs_.push_back({std::move(host), dst});
  }
  cv_.notify_all();
}

bool AdapterUploader::Queued(const DeviceAdapter* dst) {
  std::lock_guard<std::mutex> lock(mu_);
  return !pending_.contains(dst);
}

absl::Status AdapterUploader::Wait(const DeviceAdapter* dst) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !pending_.contains(dst); });
  auto it = failed_.find(dst);
  if (it == failed_.end()) return absl::OkStatus();
  absl::Status s = std::move(it->second);
  failed_.erase(it);
  return s;
}

void AdapterUploader::Run() {
  // The stage's stream and the events Stage creates live on the creator's device.
  const absl::Status device = CudaStatus(cuda::SetDevice(device_), "set device");
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and every queued job is done
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    absl::Status s = device.ok() ? job.dst->Stage(*job.host, stage_.get()) : device;
    job.host.reset();  // the host copy may go once staged
    lock.lock();
    pending_.erase(job.dst);
    if (!s.ok()) failed_[job.dst] = std::move(s);
    cv_.notify_all();
  }
}

// ---- DeviceAdapterSlots ----

absl::StatusOr<DeviceAdapter*> DeviceAdapterSlots::StartUpload(
    std::shared_ptr<const model::AdapterWeights> host) {
  if (uploader_ == nullptr) {
    PREFT_ASSIGN_OR_RETURN(uploader_, AdapterUploader::Create());
  }
  // The device copy holds the matrices in their dtype plus biases and a table: about the host
  // size, which is what room is made for.
  Drop(lru_.MakeRoom(host->bytes()));
  absl::StatusOr<std::unique_ptr<DeviceAdapter>> a = DeviceAdapter::Allocate(*host, shard_);
  if (absl::IsResourceExhausted(a.status())) {
    // Something else took the device memory: drop every copy this step does not use, retry.
    Drop(lru_.ShrinkTo(0));
    a = DeviceAdapter::Allocate(*host, shard_);
  }
  if (!a.ok()) return a.status();
  DeviceAdapter* raw = a->get();
  lru_.Insert(host->serial(), raw->bytes());
  slots_.emplace(host->serial(), *std::move(a));
  ++uploads_;
  uploader_->Enqueue(std::move(host), raw);
  return raw;
}

absl::StatusOr<const DeviceAdapter*> DeviceAdapterSlots::Get(const model::AdapterWeights* host) {
  const uint64_t key = host->serial();
  DeviceAdapter* a = nullptr;
  if (auto it = slots_.find(key); it != slots_.end()) {
    lru_.Touch(key);
    a = it->second.get();
  } else {
    // Not owned: the caller's step holds `host` until this returns, after the staging.
    PREFT_ASSIGN_OR_RETURN(a, StartUpload(std::shared_ptr<const model::AdapterWeights>(
                                  std::shared_ptr<const model::AdapterWeights>(), host)));
  }
  if (uploader_ != nullptr) {
    const absl::Status staged = uploader_->Wait(a);
    if (!staged.ok()) {
      Erase(key);  // a later request tries again
      return staged;
    }
  }
  return a;
}

void DeviceAdapterSlots::Prefetch(std::shared_ptr<const model::AdapterWeights> host) {
  if (slots_.contains(host->serial())) {
    lru_.Touch(host->serial());
    return;
  }
  (void)StartUpload(std::move(host));  // a failure is the step's Get's to report
}

absl::StatusOr<bool> DeviceAdapterSlots::Ready(const std::shared_ptr<const model::AdapterWeights>& host) {
  auto it = slots_.find(host->serial());
  if (it == slots_.end()) {
    PREFT_RETURN_IF_ERROR(StartUpload(host).status());
    it = slots_.find(host->serial());
  }
  const DeviceAdapter* a = it->second.get();
  if (uploader_ != nullptr) {
    if (!uploader_->Queued(a)) return false;
    if (absl::Status staged = uploader_->Wait(a); !staged.ok()) {  // queued: returns at once
      Erase(host->serial());
      return staged;
    }
  }
  return a->ready_event() == nullptr || !cuda::EventPending(a->ready_event());
}

void DeviceAdapterSlots::BeginStep(const std::vector<const model::AdapterWeights*>& used) {
  lru_.BeginStep();
  for (const model::AdapterWeights* host : used) {
    if (lru_.Contains(host->serial())) lru_.Touch(host->serial());
  }
}

void DeviceAdapterSlots::Put(const model::AdapterWeights* key, std::unique_ptr<DeviceAdapter> adapter) {
  Evict(key);
  lru_.Insert(key->serial(), adapter->bytes());
  slots_.emplace(key->serial(), std::move(adapter));
}

void DeviceAdapterSlots::Evict(const model::AdapterWeights* host) {
  lru_.Erase(host->serial());
  Erase(host->serial());
}

void DeviceAdapterSlots::Drop(const std::vector<uint64_t>& serials) {
  for (uint64_t s : serials) Erase(s);
  evictions_ += static_cast<int64_t>(serials.size());
}

void DeviceAdapterSlots::Erase(uint64_t serial) {
  auto it = slots_.find(serial);
  if (it == slots_.end()) return;
  if (uploader_ != nullptr) (void)uploader_->Wait(it->second.get());
  lru_.Erase(serial);
  slots_.erase(it);
}

}  // namespace preft::backend

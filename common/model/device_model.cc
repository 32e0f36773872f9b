#include "common/model/device_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/attention.cuh"
#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kernels/cuda/sampling.cuh"
#include "common/kernels/dtype.h"
#include "common/model/rope.h"

namespace preft::model {
namespace {

namespace cuda = kernels::cuda;
using kernels::DType;

absl::Status Cuda(int code, const char* what) {
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cuda::ErrorString(code)));
}

absl::Status NeedDevice() {
  if (cuda::DeviceCount() > 0) return absl::OkStatus();
  return absl::FailedPreconditionError("no CUDA device is visible");
}

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n, size_t a = kAlign) { return (n + a - 1) / a * a; }

// Byte offsets handed out in order, each aligned: the plan of one allocation.
class Placer {
 public:
  size_t Place(size_t bytes) {
    const size_t at = AlignUp(size_);
    size_ = at + bytes;
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

// Uniform bound with standard deviation `std`.
float UniformBound(double std) { return static_cast<float>(std * std::sqrt(3.0)); }

}  // namespace

// The masked rows of one adapter kind (LoRA or DiReFT) in a batch, laid out for the kernels:
// items sorted by adapter, first the rows for the per-row kernel (decode rows: BGMV), then
// the rows of adapters with kMinTileRows or more, which go in tiles (prompt chunks: SGMV).
class DeviceModel::LowRankWork {
 public:
  static constexpr size_t kMinTileRows = 4;

  // Returns the adapter's index, adding it on first sight.
  int32_t Adapter(const DeviceAdapter* a) {
    auto [it, added] = index_.try_emplace(a, static_cast<int32_t>(tables_.size()));
    if (added) {
      tables_.push_back(a->table());
      tileable_.push_back(a->max_rank() <= cuda::kMaxTileRank);
      rows_.emplace_back();
    }
    return it->second;
  }
  void AddRow(int32_t adapter, int32_t row) { rows_[adapter].push_back(row); }
  bool empty() const { return items_.empty(); }
  // Appends what fixes the kernels' launch arguments and the metadata layout (after Plan).
  void AppendShape(std::vector<int64_t>* key) const {
    key->insert(key->end(), {num_rows_, static_cast<int64_t>(items_.size()),
                             static_cast<int64_t>(tiles_.size()),
                             static_cast<int64_t>(tables_.size())});
  }

  // Orders the items and cuts the tiles; then plans their place in the metadata.
  void Plan(Placer* plan) {
    auto tiled = [&](size_t a) { return tileable_[a] && rows_[a].size() >= kMinTileRows; };
    for (size_t a = 0; a < rows_.size(); ++a) {
      if (!tiled(a)) {
        for (int32_t r : rows_[a]) items_.push_back({r, static_cast<int32_t>(a)});
      }
    }
    num_rows_ = static_cast<int64_t>(items_.size());
    for (size_t a = 0; a < rows_.size(); ++a) {
      if (!tiled(a)) continue;
      for (size_t i = 0; i < rows_[a].size(); i += cuda::kTileRows) {
        const size_t count = std::min<size_t>(cuda::kTileRows, rows_[a].size() - i);
        tiles_.push_back({static_cast<int32_t>(items_.size()), static_cast<int32_t>(count)});
        for (size_t j = i; j < i + count; ++j) items_.push_back({rows_[a][j], static_cast<int32_t>(a)});
      }
    }
    items_at_ = plan->Place(items_.size() * sizeof(cuda::LowRankItem));
    tables_at_ = plan->Place(tables_.size() * sizeof(void*));
    tiles_at_ = plan->Place(tiles_.size() * sizeof(cuda::LowRankTile));
  }
  // Copies them into the host image of the metadata whose device copy starts at `device`.
  void Fill(uint8_t* host, const DeviceBuffer& device) {
    auto put = [&](size_t at, const auto& v) {
      if (!v.empty()) std::memcpy(host + at, v.data(), v.size() * sizeof(v[0]));
    };
    put(items_at_, items_);
    put(tables_at_, tables_);
    put(tiles_at_, tiles_);
    items_dev_ = device.as<cuda::LowRankItem>(items_at_);
    tables_dev_ = device.as<const cuda::LowRankPair*>(tables_at_);
    tiles_dev_ = device.as<cuda::LowRankTile>(tiles_at_);
  }
  // Adds every row's update for `targets` (both kernels; in place when a target's y is x).
  absl::Status Launch(const float* x, int64_t x_stride, const cuda::LowRankTargets& targets,
                      void* stream) const {
    if (items_.empty()) return absl::OkStatus();
    PREFT_RETURN_IF_ERROR(Cuda(cuda::LowRankAdd(x, x_stride, tables_dev_, items_dev_, num_rows_,
                                                targets, stream),
                               "low-rank rows"));
    return Cuda(cuda::LowRankAddTiles(x, x_stride, tables_dev_, items_dev_, tiles_dev_,
                                      static_cast<int64_t>(tiles_.size()), targets, stream),
                "low-rank tiles");
  }

 private:
  absl::flat_hash_map<const DeviceAdapter*, int32_t> index_;
  std::vector<const cuda::LowRankPair*> tables_;
  std::vector<bool> tileable_;
  std::vector<std::vector<int32_t>> rows_;
  std::vector<cuda::LowRankItem> items_;
  std::vector<cuda::LowRankTile> tiles_;
  int64_t num_rows_ = 0;
  size_t items_at_ = 0, tables_at_ = 0, tiles_at_ = 0;
  const cuda::LowRankItem* items_dev_ = nullptr;
  const cuda::LowRankPair* const* tables_dev_ = nullptr;
  const cuda::LowRankTile* tiles_dev_ = nullptr;
};

// ---- DeviceBuffer ----

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cuda::Free(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cuda::Free(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  if (const int e = cuda::Malloc(&b.ptr_, bytes); e != 0) {
    b.ptr_ = nullptr;
    size_t free_b = 0, total_b = 0;
    cuda::MemoryInfo(&free_b, &total_b);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                     " bytes of device memory (", free_b,
                                                     " free): ", cuda::ErrorString(e)));
  }
  b.size_ = bytes;
  return b;
}

// ---- DeviceKvCache ----

absl::StatusOr<std::unique_ptr<DeviceKvCache>> DeviceKvCache::Create(
    const kv::KvCacheShape& shape) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  if (shape.num_layers <= 0 || shape.num_blocks <= 0 || shape.block_tokens <= 0 ||
      shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    return absl::InvalidArgumentError("KV cache shape must be positive in every dimension");
  }
  const size_t bytes = static_cast<size_t>(shape.num_blocks) * shape.bytes_per_block_all_layers();
  PREFT_ASSIGN_OR_RETURN(DeviceBuffer data, DeviceBuffer::Allocate(bytes));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::Memset(data.get(), 0, bytes, nullptr), "memset"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
  return std::unique_ptr<DeviceKvCache>(new DeviceKvCache(shape, std::move(data)));
}

absl::StatusOr<int64_t> DeviceKvCache::BlocksThatFit(const kv::KvCacheShape& shape,
                                                     double fraction, size_t reserve_bytes) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("fraction must be in (0, 1], got ", fraction));
  }
  size_t free_b = 0, total_b = 0;
  PREFT_RETURN_IF_ERROR(Cuda(cuda::MemoryInfo(&free_b, &total_b), "memory info"));
  free_b = free_b > reserve_bytes ? free_b - reserve_bytes : 0;
  return static_cast<int64_t>(static_cast<double>(free_b) * fraction /
                              static_cast<double>(shape.bytes_per_block_all_layers()));
}

absl::Status DeviceKvCache::CopyToHost(std::vector<float>* host) const {
  host->resize(data_.size() / sizeof(float));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToHost(host->data(), data_.get(), data_.size(), nullptr),
                             "copy to host"));
  return Cuda(cuda::StreamSynchronize(nullptr), "synchronize");
}

namespace {

// InvalidArgument unless `host` has `device`'s shape (with every rank's KV heads) and every
// block is in range.
absl::Status CheckBlockCopy(const kv::KvCacheShape& device, const kv::KvCacheShape& host,
                            const std::vector<int32_t>& blocks, const TensorShard& shard) {
  if (host.num_layers != device.num_layers || host.num_blocks != device.num_blocks ||
      host.block_tokens != device.block_tokens ||
      host.num_kv_heads != device.num_kv_heads * shard.ranks || host.head_dim != device.head_dim) {
    return absl::InvalidArgumentError("the host KV cache's shape differs from the device's");
  }
  for (int32_t b : blocks) {
    if (b < 0 || b >= device.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV block ", b, " is outside the cache's ", device.num_blocks));
    }
  }
  return absl::OkStatus();
}

// Runs KvHeadCopies between a device cache and a host cache of `full`'s shape (both given by
// layer 0, block 0): with one rank each is one contiguous piece, a plain copy; else the rank's
// heads of each block's K and V in their place among every head's.
absl::Status CopyKvHeads(float* device, float* host, const kv::KvCacheShape& full,
                         const TensorShard& shard, const std::vector<int32_t>& blocks,
                         bool to_host) {
  constexpr size_t f = sizeof(float);
  for (const StridedCopy& c : KvHeadCopies(full, shard, blocks)) {
    float* d = device + c.src_offset;
    float* h = host + c.dst_offset;
    int e = 0;
    if (c.width == c.src_pitch && c.width == c.dst_pitch) {
      const size_t bytes = c.width * c.rows * f;
      e = to_host ? cuda::CopyToHost(h, d, bytes, nullptr)
                  : cuda::CopyToDevice(d, h, bytes, nullptr);
    } else {
      e = to_host ? cuda::Copy2DToHost(h, c.dst_pitch * f, d, c.src_pitch * f, c.width * f,
                                       c.rows, nullptr)
                  : cuda::Copy2DToDevice(d, c.src_pitch * f, h, c.dst_pitch * f, c.width * f,
                                         c.rows, nullptr);
    }
    PREFT_RETURN_IF_ERROR(Cuda(e, to_host ? "KV copy to host" : "KV copy to the device"));
  }
  return Cuda(cuda::StreamSynchronize(nullptr), "synchronize");
}

}  // namespace

absl::Status DeviceKvCache::CopyBlocksToHost(const std::vector<int32_t>& blocks,
                                             kv::KvCache* host, const TensorShard& shard) const {
  PREFT_RETURN_IF_ERROR(CheckBlockCopy(shape_, host->shape(), blocks, shard));
  return CopyKvHeads(const_cast<float*>(layer_base(0)), host->layer_base(0), host->shape(), shard,
                     blocks, /*to_host=*/true);
}

absl::Status DeviceKvCache::CopyBlocksFromHost(const kv::KvCache& host,
                                               const std::vector<int32_t>& blocks,
                                               const TensorShard& shard) {
  PREFT_RETURN_IF_ERROR(CheckBlockCopy(shape_, host.shape(), blocks, shard));
  return CopyKvHeads(layer_base(0), const_cast<float*>(host.layer_base(0)), host.shape(), shard,
                     blocks, /*to_host=*/false);
}

absl::Status DeviceKvCache::PoisonForTesting() {
  PREFT_RETURN_IF_ERROR(Cuda(cuda::Memset(data_.get(), 0xff, data_.size(), nullptr), "memset"));
  return Cuda(cuda::StreamSynchronize(nullptr), "synchronize");
}

// ---- UploadStage ----

absl::StatusOr<std::unique_ptr<UploadStage>> UploadStage::Create() {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  std::unique_ptr<UploadStage> stage(new UploadStage());
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamCreate(&stage->stream_), "upload stream"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::EventCreate(&stage->copied_), "upload event"));
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
  PREFT_RETURN_IF_ERROR(Cuda(cuda::EventSynchronize(copied_), "upload"));
  if (bytes > size_) {
    if (pinned_ != nullptr) cuda::HostFree(pinned_);
    pinned_ = nullptr;
    size_ = 0;
    void* p = nullptr;
    // Grown in steps, so adapters of slightly different sizes do not re-pin each time.
    const size_t want = std::max(bytes + bytes / 4, size_t{1} << 20);
    PREFT_RETURN_IF_ERROR(Cuda(cuda::HostAlloc(&p, want), "page-locked staging"));
    pinned_ = static_cast<uint8_t*>(p);
    size_ = want;
  }
  return pinned_;
}

absl::Status UploadStage::Copy(void* dst, size_t bytes, void* done) {
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(dst, pinned_, bytes, stream_), "upload"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::EventRecord(copied_, stream_), "upload"));
  return Cuda(cuda::EventRecord(done, stream_), "upload");
}

// ---- DeviceAdapter ----

DeviceAdapter::~DeviceAdapter() {
  // Freeing data_ waits for the device, so a queued copy into it is finished first.
  data_ = DeviceBuffer();
  if (ready_ != nullptr) cuda::EventDestroy(ready_);
}

namespace {

// The pair in table entry (layer, slot) of `a`, or null when that entry is unused.
const LowRank* PairOf(const AdapterWeights& a, int64_t layer, int slot) {
  if (a.kind() == AdapterKind::kDireft) {
    return slot == DeviceAdapter::kDireftSlot ? &a.direft(layer) : nullptr;
  }
  return slot < kNumProjections ? &a.lora(layer, static_cast<Projection>(slot)) : nullptr;
}

// The part of the pair in `slot` that rank `shard` holds: LoRA follows its projection's split;
// DiReFT (on the whole residual stream) is replicated.
LowRankSlice SliceOfSlot(const LowRank& lr, int slot, const TensorShard& shard) {
  if (slot == DeviceAdapter::kDireftSlot) {
    return {{0, lr.shrink.cols}, {0, lr.expand.cols}, true};
  }
  return SliceOfLowRank(lr, static_cast<Projection>(slot), shard);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceAdapter>> DeviceAdapter::Allocate(const AdapterWeights& a,
                                                                      const TensorShard& shard) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  const int64_t layers = a.num_layers();
  std::unique_ptr<DeviceAdapter> out(new DeviceAdapter());
  out->placed_.resize(layers * kEntriesPerLayer);
  Placer plan;
  for (int64_t l = 0; l < layers; ++l) {
    for (int slot = 0; slot < kEntriesPerLayer; ++slot) {
      const LowRank* lr = PairOf(a, l, slot);
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

void DeviceAdapter::Fill(const AdapterWeights& a, uint8_t* staging) const {
  // Padding between the pieces is never read: it may hold anything.
  auto* table = reinterpret_cast<cuda::LowRankPair*>(staging + table_at_);
  for (int64_t l = 0; l < a.num_layers(); ++l) {
    for (int slot = 0; slot < kEntriesPerLayer; ++slot) {
      const LowRank* lr = PairOf(a, l, slot);
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

absl::Status DeviceAdapter::Stage(const AdapterWeights& a, UploadStage* stage) {
  PREFT_ASSIGN_OR_RETURN(uint8_t* staging, stage->Buffer(data_.size()));
  Fill(a, staging);
  if (ready_ == nullptr) PREFT_RETURN_IF_ERROR(Cuda(cuda::EventCreate(&ready_), "upload event"));
  return stage->Copy(data_.get(), data_.size(), ready_);
}

absl::StatusOr<std::unique_ptr<DeviceAdapter>> DeviceAdapter::Random(const ModelConfig& c,
                                                                    AdapterKind kind,
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
      const bool used = kind == AdapterKind::kDireft ? slot == kDireftSlot : slot < kNumProjections;
      if (!used) continue;
      const auto [in, out] = slot == kDireftSlot
                                 ? ProjectionDims{c.hidden_size, c.hidden_size}
                                 : DimsOf(c, static_cast<Projection>(slot));
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
    PREFT_RETURN_IF_ERROR(Cuda(cuda::FillRandomBf16(s, p.rank * p.in, seed * 1315423911u + 2 * e,
                                                    UniformBound(1.0 / std::sqrt(p.in)), nullptr),
                               "fill"));
    PREFT_RETURN_IF_ERROR(Cuda(cuda::FillRandomBf16(x, p.rank * p.out, seed * 1315423911u + 2 * e + 1,
                                                    UniformBound(0.3 / std::sqrt(p.rank)), nullptr),
                               "fill"));
    p.shrink = s;
    p.expand = x;
  }
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(out->data_.as<uint8_t>(table_at), table.data(),
                                                table.size() * sizeof(table[0]), nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
  out->table_ = out->data_.as<cuda::LowRankPair>(table_at);
  return out;
}

// ---- AdapterUploader ----

absl::StatusOr<std::unique_ptr<AdapterUploader>> AdapterUploader::Create() {
  std::unique_ptr<AdapterUploader> u(new AdapterUploader());
  PREFT_RETURN_IF_ERROR(Cuda(cuda::GetDevice(&u->device_), "current device"));
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

void AdapterUploader::Enqueue(std::shared_ptr<const AdapterWeights> host, DeviceAdapter* dst) {
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
  const absl::Status device = Cuda(cuda::SetDevice(device_), "set device");
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
    std::shared_ptr<const AdapterWeights> host) {
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

absl::StatusOr<const DeviceAdapter*> DeviceAdapterSlots::Get(const AdapterWeights* host) {
  const uint64_t key = host->serial();
  DeviceAdapter* a = nullptr;
  if (auto it = slots_.find(key); it != slots_.end()) {
    lru_.Touch(key);
    a = it->second.get();
  } else {
    // Not owned: the caller's step holds `host` until this returns, after the staging.
    PREFT_ASSIGN_OR_RETURN(a, StartUpload(std::shared_ptr<const AdapterWeights>(
                                  std::shared_ptr<const AdapterWeights>(), host)));
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

void DeviceAdapterSlots::Prefetch(std::shared_ptr<const AdapterWeights> host) {
  if (slots_.contains(host->serial())) {
    lru_.Touch(host->serial());
    return;
  }
  (void)StartUpload(std::move(host));  // a failure is the step's Get's to report
}

absl::StatusOr<bool> DeviceAdapterSlots::Ready(const std::shared_ptr<const AdapterWeights>& host) {
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

void DeviceAdapterSlots::BeginStep(const std::vector<const AdapterWeights*>& used) {
  lru_.BeginStep();
  for (const AdapterWeights* host : used) {
    if (lru_.Contains(host->serial())) lru_.Touch(host->serial());
  }
}

void DeviceAdapterSlots::Put(const AdapterWeights* key, std::unique_ptr<DeviceAdapter> adapter) {
  Evict(key);
  lru_.Insert(key->serial(), adapter->bytes());
  slots_.emplace(key->serial(), std::move(adapter));
}

void DeviceAdapterSlots::Evict(const AdapterWeights* host) {
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

// ---- DeviceModel ----

struct DeviceModel::Meta {
  size_t tokens = 0, positions = 0, slots = 0, logit_rows = 0, block_tables = 0, seqs = 0;
};

DeviceModel::~DeviceModel() {
  ClearGraphs();
  delete blas_;
  if (stream_ != nullptr) {
    cuda::StreamSynchronize(stream_);
    cuda::StreamDestroy(stream_);
  }
}

kv::KvCacheShape DeviceModel::CacheShape(int64_t num_blocks, int64_t block_tokens) const {
  return {config_.num_layers, num_blocks, block_tokens, config_.num_kv_heads, config_.head_dim};
}

// Plans and allocates the weights (the layout Upload copies into and Random fills), the
// stream and the cuBLAS handle. lm_head shares the embedding when tied. Under tensor
// parallelism the matrices are the rank's slices, and o's bias (added to a partial sum) is
// rank 0's alone.
absl::Status DeviceModel::Init(const ModelConfig& full, const TensorShard& shard,
                               cuda::Collective* collective) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  PREFT_RETURN_IF_ERROR(CheckTensorParallel(full, shard.ranks));
  if (!shard.whole() && collective == nullptr) {
    return absl::InvalidArgumentError("a tensor-parallel rank needs its group's collective");
  }
  full_config_ = full;
  config_ = ShardConfig(full, shard);
  shard_ = shard;
  collective_ = shard.whole() ? nullptr : collective;
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  Placer plan;
  const size_t bf = sizeof(uint16_t), f = sizeof(float);
  const size_t embed_at = plan.Place(c.vocab_size * d * bf);
  const size_t head_at = c.tie_word_embeddings ? embed_at : plan.Place(c.vocab_size * d * bf);
  struct LayerAt {
    size_t m[kNumProjections];
    size_t qb = 0, kb = 0, vb = 0, ob = 0, n1 = 0, n2 = 0;
  };
  std::vector<LayerAt> at(c.num_layers);
  for (LayerAt& l : at) {
    for (int p = 0; p < kNumProjections; ++p) {
      const auto [in, out] = DimsOf(c, static_cast<Projection>(p));
      l.m[p] = plan.Place(in * out * bf);
    }
  }
  const bool o_bias = c.attention_bias && c.architecture == Architecture::kLlama && shard.rank == 0;
  for (LayerAt& l : at) {
    if (c.attention_bias) {
      l.qb = plan.Place(q_out * f);
      l.kb = plan.Place(kv_out * f);
      l.vb = plan.Place(kv_out * f);
      if (o_bias) l.ob = plan.Place(d * f);
    }
    l.n1 = plan.Place(d * f);
    l.n2 = plan.Place(d * f);
  }
  const size_t norm_at = plan.Place(d * f);
  const size_t freq_at = plan.Place(c.head_dim / 2 * f);
  PREFT_ASSIGN_OR_RETURN(weights_, DeviceBuffer::Allocate(plan.size()));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::Memset(weights_.get(), 0, weights_.size(), nullptr), "memset"));
  embed_ = weights_.as<uint16_t>(embed_at);
  lm_head_ = weights_.as<uint16_t>(head_at);
  final_norm_ = weights_.as<float>(norm_at);
  inv_freq_ = weights_.as<float>(freq_at);
  layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const LayerAt& l = at[i];
    DeviceLayer& dl = layers_[i];
    const uint16_t** m[kNumProjections] = {&dl.q, &dl.k, &dl.v, &dl.o, &dl.gate, &dl.up, &dl.down};
    for (int p = 0; p < kNumProjections; ++p) *m[p] = weights_.as<uint16_t>(l.m[p]);
    dl.q_bias = c.attention_bias ? weights_.as<float>(l.qb) : nullptr;
    dl.k_bias = c.attention_bias ? weights_.as<float>(l.kb) : nullptr;
    dl.v_bias = c.attention_bias ? weights_.as<float>(l.vb) : nullptr;
    dl.o_bias = o_bias ? weights_.as<float>(l.ob) : nullptr;
    dl.input_norm = weights_.as<float>(l.n1);
    dl.post_attention_norm = weights_.as<float>(l.n2);
  }
  const std::vector<float> inv_freq = RopeInverseFrequencies(c);
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(const_cast<float*>(inv_freq_), inv_freq.data(),
                                                inv_freq.size() * f, nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamCreate(&stream_), "stream"));
  return Cuda(cuda::Blas::Create(stream_, &blas_), "cuBLAS handle");
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Upload(const Model& host,
                                                                const TensorShard& shard,
                                                                cuda::Collective* collective) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  ModelConfig c = host.config();
  c.tie_word_embeddings = host.lm_head().data == host.embed().data;
  PREFT_RETURN_IF_ERROR(m->Init(c, shard, collective));
  // Matrices go as bf16: straight from the mapping, or converted in chunks.
  std::vector<uint16_t> chunk;
  auto matrix = [&](const uint16_t* dst, const kernels::MatrixView& v) -> absl::Status {
    const size_t n = v.rows * v.cols;
    auto* out = const_cast<uint16_t*>(dst);
    if (v.dtype == DType::kBF16) {
      PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(out, v.data, n * 2, nullptr), "copy"));
      return Cuda(cuda::StreamSynchronize(nullptr), "synchronize");
    }
    constexpr size_t kChunk = size_t{1} << 22;
    chunk.resize(std::min(n, kChunk));
    for (size_t at = 0; at < n; at += kChunk) {
      const size_t len = std::min(kChunk, n - at);
      for (size_t i = 0; i < len; ++i) chunk[i] = kernels::F32ToBf16(kernels::LoadAsF32(v.data, v.dtype, at + i));
      PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(out + at, chunk.data(), len * 2, nullptr), "copy"));
      PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
    }
    return absl::OkStatus();
  };
  // A projection's weight: the rank's slice of it, cut on the host first.
  std::vector<uint8_t> slice;
  auto projection = [&](const uint16_t* dst, const kernels::MatrixView& v,
                        Projection p) -> absl::Status {
    if (shard.whole()) return matrix(dst, v);
    const WeightSlice ws = SliceOfWeight(v, p, shard);
    slice.resize(ws.rows.size() * ws.cols.size() * kernels::DTypeSize(v.dtype));
    CopySubMatrix(v, ws.rows, ws.cols, slice.data());
    return matrix(dst, {slice.data(), v.dtype, ws.rows.size(), ws.cols.size()});
  };
  auto floats = [&](const float* dst, const std::vector<float>& v) -> absl::Status {
    if (dst == nullptr || v.empty()) return absl::OkStatus();
    return Cuda(cuda::CopyToDevice(const_cast<float*>(dst), v.data(), v.size() * sizeof(float),
                                   nullptr),
                "copy");
  };
  // A column-parallel projection's bias: the rank's outputs.
  auto bias = [&](const float* dst, const std::vector<float>& v) -> absl::Status {
    if (dst == nullptr || v.empty() || shard.whole()) return floats(dst, v);
    const ShardRange r = RangeOf(static_cast<int64_t>(v.size()), shard);
    return floats(dst, std::vector<float>(v.begin() + r.begin, v.begin() + r.end));
  };
  PREFT_RETURN_IF_ERROR(matrix(m->embed_, host.embed()));
  if (!c.tie_word_embeddings) PREFT_RETURN_IF_ERROR(matrix(m->lm_head_, host.lm_head()));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const Model::LayerWeights& hl = host.layer(i);
    const DeviceLayer& dl = m->layers_[i];
    const uint16_t* dst[kNumProjections] = {dl.q, dl.k, dl.v, dl.o, dl.gate, dl.up, dl.down};
    const kernels::MatrixView* src[kNumProjections] = {&hl.q,    &hl.k,  &hl.v,   &hl.o,
                                                       &hl.gate, &hl.up, &hl.down};
    for (int p = 0; p < kNumProjections; ++p) {
      PREFT_RETURN_IF_ERROR(projection(dst[p], *src[p], static_cast<Projection>(p)));
    }
    PREFT_RETURN_IF_ERROR(bias(dl.q_bias, hl.q_bias));
    PREFT_RETURN_IF_ERROR(bias(dl.k_bias, hl.k_bias));
    PREFT_RETURN_IF_ERROR(bias(dl.v_bias, hl.v_bias));
    PREFT_RETURN_IF_ERROR(floats(dl.o_bias, hl.o_bias));  // rank 0's alone
    PREFT_RETURN_IF_ERROR(floats(dl.input_norm, hl.input_norm));
    PREFT_RETURN_IF_ERROR(floats(dl.post_attention_norm, hl.post_attention_norm));
  }
  PREFT_RETURN_IF_ERROR(floats(m->final_norm_, host.final_norm()));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
  return m;
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Random(const ModelConfig& full,
                                                                uint64_t seed,
                                                                const TensorShard& shard,
                                                                cuda::Collective* collective) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  PREFT_RETURN_IF_ERROR(m->Init(full, shard, collective));
  const ModelConfig& c = m->config_;  // the rank's shapes
  uint64_t stream_id = (seed + shard.rank * 0x51ed27ull) * 0x9e3779b97f4a7c15ull;
  auto fill = [&](const uint16_t* dst, int64_t in, int64_t out, double std) {
    return Cuda(cuda::FillRandomBf16(const_cast<uint16_t*>(dst), in * out, ++stream_id,
                                     UniformBound(std), nullptr),
                "fill");
  };
  const int64_t d = c.hidden_size;
  PREFT_RETURN_IF_ERROR(fill(m->embed_, c.vocab_size, d, 2.5 / std::sqrt(d)));
  if (!c.tie_word_embeddings) PREFT_RETURN_IF_ERROR(fill(m->lm_head_, c.vocab_size, d, 2.5 / std::sqrt(d)));
  const std::vector<float> ones(std::max(d, int64_t{1}), 1.f);
  for (const DeviceLayer& l : m->layers_) {
    const uint16_t* mats[kNumProjections] = {l.q, l.k, l.v, l.o, l.gate, l.up, l.down};
    for (int p = 0; p < kNumProjections; ++p) {
      const auto [in, out] = DimsOf(c, static_cast<Projection>(p));
      // Fan-in scaled by the whole projection's inputs, as the unsharded model is.
      const int64_t fan_in = DimsOf(full, static_cast<Projection>(p)).in;
      PREFT_RETURN_IF_ERROR(fill(mats[p], in, out, 1.0 / std::sqrt(fan_in)));
    }
    for (const float* norm : {l.input_norm, l.post_attention_norm}) {
      PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(const_cast<float*>(norm), ones.data(),
                                                    d * sizeof(float), nullptr),
                                 "copy"));
    }
  }
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(const_cast<float*>(m->final_norm_), ones.data(),
                                                d * sizeof(float), nullptr),
                             "copy"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(nullptr), "synchronize"));
  return m;
}

absl::Status DeviceModel::EnsureScratch(int64_t tokens, int64_t rows) {
  if (tokens <= scratch_tokens_ && rows <= scratch_rows_) return absl::OkStatus();
  const ModelConfig& c = config_;
  tokens = std::max(tokens, scratch_tokens_);
  rows = std::max(rows, scratch_rows_);
  const int64_t d = c.hidden_size, q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim, inter = c.intermediate_size;
  Placer plan;
  const size_t f = sizeof(float);
  const size_t x = plan.Place(tokens * d * f), h = plan.Place(tokens * d * f);
  const size_t tmp = plan.Place(tokens * d * f);
  const size_t q = plan.Place(tokens * q_out * f), attn = plan.Place(tokens * q_out * f);
  const size_t k = plan.Place(tokens * kv_out * f), v = plan.Place(tokens * kv_out * f);
  const size_t gate = plan.Place(tokens * inter * f), up = plan.Place(tokens * inter * f);
  const size_t last = plan.Place(rows * d * f), logits = plan.Place(rows * c.vocab_size * f);
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(stream_), "synchronize"));
  scratch_ = DeviceBuffer();
  PREFT_ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(plan.size()));
  x_ = scratch_.as<float>(x);
  h_ = scratch_.as<float>(h);
  tmp_ = scratch_.as<float>(tmp);
  q_ = scratch_.as<float>(q);
  attn_ = scratch_.as<float>(attn);
  k_ = scratch_.as<float>(k);
  v_ = scratch_.as<float>(v);
  gate_ = scratch_.as<float>(gate);
  up_ = scratch_.as<float>(up);
  last_ = scratch_.as<float>(last);
  logits_ = scratch_.as<float>(logits);
  scratch_tokens_ = tokens;
  scratch_rows_ = rows;
  return absl::OkStatus();
}

absl::Status DeviceModel::Run(const ForwardBatch& batch, DeviceKvCache* cache,
                              DeviceAdapterSlots* adapters) {
  bool agreed = false;
  auto agree = [&](absl::Status mine) {
    agreed = true;
    return agree_ ? agree_(mine) : mine;
  };
  absl::Status ran = RunStep(batch, cache, adapters, agree);
  if (!agreed) agree(ran).IgnoreError();  // the other ranks learn of this rank's failure
  return ran;
}

absl::Status DeviceModel::RunStep(const ForwardBatch& batch, DeviceKvCache* cache,
                                  DeviceAdapterSlots* adapters,
                                  const std::function<absl::Status(absl::Status)>& agree) {
  const ModelConfig& c = config_;
  const kv::KvCacheShape& cs = cache->shape();
  PREFT_RETURN_IF_ERROR(CheckBatchFits(c, cs, batch));
  const int64_t T = batch.num_tokens(), R = static_cast<int64_t>(batch.logit_rows.size());
  const int64_t S = static_cast<int64_t>(batch.sequences.size());
  const int64_t d = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_out = c.num_heads * hd, bt = cs.block_tokens;
  PREFT_RETURN_IF_ERROR(EnsureScratch(T, R));

  // Adapters: one table per distinct adapter, one item per masked row. The slots keep this
  // step's copies until the next step begins.
  std::vector<const AdapterWeights*> used;
  {
    absl::flat_hash_set<const AdapterWeights*> seen;
    for (const ForwardBatch::Sequence& s : batch.sequences) {
      if (s.adapter != nullptr && seen.insert(s.adapter).second) {
        PREFT_RETURN_IF_ERROR(CheckAdapterFits(full_config_, *s.adapter));
        used.push_back(s.adapter);
      }
    }
  }
  adapters->BeginStep(used);
  // Uploads run on their own stream: this step's kernels wait (on the device) for the copies
  // of its adapters. Outside any graph capture, so a replayed graph is ordered after them.
  absl::flat_hash_map<const AdapterWeights*, const DeviceAdapter*> on_device;
  for (const AdapterWeights* a : used) {
    PREFT_ASSIGN_OR_RETURN(const DeviceAdapter* da, adapters->Get(a));
    if (da->ready_event() != nullptr) {
      PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamWaitEvent(stream_, da->ready_event()), "upload wait"));
    }
    on_device[a] = da;
  }
  LowRankWork lora, direft;
  int64_t total_blocks = 0;
  {
    int64_t t = 0;
    for (const ForwardBatch::Sequence& s : batch.sequences) {
      total_blocks += s.num_blocks;
      if (s.adapter != nullptr) {
        const DeviceAdapter* da = on_device.at(s.adapter);
        LowRankWork& work = s.adapter->kind() == AdapterKind::kLora ? lora : direft;
        const int32_t a = work.Adapter(da);
        for (int64_t i = t; i < t + s.num_new; ++i) {
          if (batch.adapter_mask[i]) work.AddRow(a, static_cast<int32_t>(i));
        }
      }
      t += s.num_new;
    }
  }

  // Metadata: plan, size the device copy, then fill the host image with device addresses.
  // The block tables go last: every address a kernel takes as an argument then depends on
  // the step's shape alone, not on how many blocks its sequences hold, so a decode graph
  // serves every step of its shape (with the table size in the key, a batch whose sequences
  // cross block boundaries at different steps recorded a new graph almost every step).
  Meta at;
  Placer plan;
  at.tokens = plan.Place(T * sizeof(int32_t));
  at.positions = plan.Place(T * sizeof(int32_t));
  at.slots = plan.Place(T * sizeof(int64_t));
  at.logit_rows = plan.Place(R * sizeof(int32_t));
  at.seqs = plan.Place(S * sizeof(kernels::AttentionSeq));
  lora.Plan(&plan);
  direft.Plan(&plan);
  at.block_tables = plan.Place(total_blocks * sizeof(int32_t));
  PREFT_RETURN_IF_ERROR(Reserve(&meta_, plan.size()));
  meta_host_.assign(plan.size(), 0);
  auto host = [&](size_t off) { return meta_host_.data() + off; };
  auto copy_in = [&](size_t off, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(host(off), src, bytes);
  };
  copy_in(at.tokens, batch.token_ids.data(), T * sizeof(int32_t));
  copy_in(at.positions, batch.positions.data(), T * sizeof(int32_t));
  copy_in(at.logit_rows, batch.logit_rows.data(), R * sizeof(int32_t));
  lora.Fill(meta_host_.data(), meta_);
  direft.Fill(meta_host_.data(), meta_);
  int64_t max_new = 0;
  {
    auto* slots = reinterpret_cast<int64_t*>(host(at.slots));
    auto* tables = reinterpret_cast<int32_t*>(host(at.block_tables));
    auto* seqs = reinterpret_cast<kernels::AttentionSeq*>(host(at.seqs));
    int64_t t = 0, table_pos = 0;
    for (int64_t si = 0; si < S; ++si) {
      const ForwardBatch::Sequence& s = batch.sequences[si];
      if (s.num_blocks > 0) {
        std::memcpy(tables + table_pos, s.block_table, s.num_blocks * sizeof(int32_t));
      }
      for (int64_t i = 0; i < s.num_new; ++i) {
        const int64_t pos = batch.positions[t + i];
        slots[t + i] = static_cast<int64_t>(s.block_table[pos / bt]) * bt + pos % bt;
      }
      seqs[si] = {q_ + t * q_out, attn_ + t * q_out,
                  meta_.as<int32_t>(at.block_tables) + table_pos, s.num_new, s.context_len};
      max_new = std::max(max_new, s.num_new);
      t += s.num_new;
      table_pos += s.num_blocks;
    }
  }
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::CopyToDevice(meta_.get(), meta_host_.data(), plan.size(), stream_), "copy"));
  const Step step{T,
                  R,
                  S,
                  max_new,
                  meta_.as<int32_t>(at.tokens),
                  meta_.as<int32_t>(at.positions),
                  meta_.as<int64_t>(at.slots),
                  meta_.as<int32_t>(at.logit_rows),
                  meta_.as<kernels::AttentionSeq>(at.seqs)};
  // The decode attention's split workspace (its size is fixed by the step's shape).
  const kernels::PagedKvLayout geometry{nullptr, 0, 0, bt, c.num_kv_heads, hd};
  PREFT_RETURN_IF_ERROR(Reserve(
      &attention_parts_,
      cuda::AttentionWorkspaceFloats(S, max_new, geometry, c.num_heads) * sizeof(float)));
  const bool capturable = collective_ == nullptr || collective_->capturable();
  const bool graph = use_graphs_ && capturable && max_new == 1;
  // Nothing inside a capture may allocate: size the GEMM input copy for this shape first.
  if (graph) {
    PREFT_RETURN_IF_ERROR(Cuda(blas_->Reserve(std::max(T, R) * std::max({d, q_out, inter})),
                               "reserve"));
  }
  PREFT_RETURN_IF_ERROR(agree(absl::OkStatus()));
  if (!graph) return Launch(step, cache, lora, direft);

  // Decode steps replay a graph recorded for their shape (the kernels' arguments are fixed
  // by the shape, the cache and the buffers, all in the key; the data is in meta_).
  std::vector<int64_t> key = {T, R, S, reinterpret_cast<int64_t>(cache->layer_base(0)),
                              reinterpret_cast<int64_t>(meta_.get()),
                              reinterpret_cast<int64_t>(scratch_.get()),
                              reinterpret_cast<int64_t>(attention_parts_.get())};
  lora.AppendShape(&key);
  direft.AppendShape(&key);
  if (blas_->generation() != graphs_blas_generation_) {  // that copy moved: every graph is stale
    ClearGraphs();
    graphs_blas_generation_ = blas_->generation();
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxGraphs) ClearGraphs();
    PREFT_RETURN_IF_ERROR(Cuda(cuda::GraphCaptureBegin(stream_), "graph capture"));
    const absl::Status launched = Launch(step, cache, lora, direft);
    void* exec = nullptr;
    const int ended = cuda::GraphCaptureEnd(stream_, &exec);
    PREFT_RETURN_IF_ERROR(launched);
    PREFT_RETURN_IF_ERROR(Cuda(ended, "graph capture"));
    it = graphs_.emplace(key, exec).first;
    ++graph_captures_;
  }
  return Cuda(cuda::GraphLaunch(it->second, stream_), "graph launch");
}

absl::Status DeviceModel::Launch(const Step& step, DeviceKvCache* cache, const LowRankWork& lora,
                                 const LowRankWork& direft) {
  const ModelConfig& c = config_;
  const kv::KvCacheShape& cs = cache->shape();
  const int64_t T = step.tokens, R = step.rows, S = step.seqs;
  const int64_t d = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd, bt = cs.block_tokens;
  if (poison_scratch_) {
    PREFT_RETURN_IF_ERROR(
        Cuda(cuda::Memset(scratch_.get(), 0xff, scratch_.size(), stream_), "memset"));
  }
  const int32_t* tokens = step.token_ids;
  const int32_t* positions = step.positions;
  const int64_t* slots = step.slots;
  const int32_t* logit_rows = step.logit_rows;
  const kernels::AttentionSeq* seqs = step.attention;
  const int64_t max_new = step.max_new;

  // One LoRA call: every adapter's update of projections reading x ([T, in]).
  auto apply_lora = [&](int64_t li, const float* x, int64_t in,
                        std::initializer_list<std::tuple<Projection, float*, int64_t>> outs) {
    cuda::LowRankTargets targets;
    for (const auto& [p, y, stride] : outs) {
      targets.target[targets.num_targets++] = {
          static_cast<int32_t>(DeviceAdapter::Entry(li, static_cast<int>(p))), y, stride};
    }
    return lora.Launch(x, in, targets, stream_);
  };
  auto linear = [&](const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                    const float* bias, float* y) {
    return Cuda(blas_->Linear(x, m, w, n, k, bias, y), "linear");
  };
  // Projections that read one x (q, k, v; gate, up): x rounded once, or one GEMV launch.
  auto linear_shared = [&](const float* x, int64_t m, int64_t k,
                           std::initializer_list<cuda::LinearOutput> outs) {
    return Cuda(blas_->LinearShared(x, m, k, outs.begin(), static_cast<int>(outs.size())),
                "linear");
  };

  PREFT_RETURN_IF_ERROR(Cuda(cuda::GatherRows(embed_, DType::kBF16, d, tokens, T, x_, stream_),
                             "embedding"));
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t window = c.architecture == Architecture::kMistral ? c.sliding_window : 0;
  // A residual add is fused with the norm after it; the MLP's add waits for the next layer's
  // input norm (or the end), unless a DiReFT update must see x first.
  bool mlp_out_pending = false;  // tmp_ is still to be added to x_
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const DeviceLayer& l = layers_[li];
    PREFT_RETURN_IF_ERROR(Cuda(mlp_out_pending
                                   ? cuda::AddRmsNorm(x_, tmp_, l.input_norm, T, d, eps, h_, stream_)
                                   : cuda::RmsNorm(x_, l.input_norm, T, d, eps, h_, stream_),
                               "norm"));
    PREFT_RETURN_IF_ERROR(linear_shared(h_, T, d,
                                        {{l.q, q_out, l.q_bias, q_},
                                         {l.k, kv_out, l.k_bias, k_},
                                         {l.v, kv_out, l.v_bias, v_}}));
    PREFT_RETURN_IF_ERROR(apply_lora(li, h_, d,
                                     {{Projection::kQ, q_, q_out},
                                      {Projection::kK, k_, kv_out},
                                      {Projection::kV, v_, kv_out}}));
    const kernels::PagedKvLayout layout{cache->layer_base(li), cs.block_floats(),
                                        cache->v_offset(),     bt,
                                        c.num_kv_heads,        hd};
    PREFT_RETURN_IF_ERROR(Cuda(cuda::RopeWriteKv(positions, inv_freq_, q_, c.num_heads, k_, v_,
                                                 slots, T, cache->layer_base(li), layout,
                                                 stream_),
                               "RoPE and KV write"));
    PREFT_RETURN_IF_ERROR(Cuda(cuda::PagedAttention(seqs, S, max_new, layout, c.num_heads, scale,
                                                    window, attention_parts_.as<float>(0),
                                                    stream_),
                               "attention"));
    PREFT_RETURN_IF_ERROR(linear(attn_, T, l.o, d, q_out, l.o_bias, tmp_));
    PREFT_RETURN_IF_ERROR(apply_lora(li, attn_, q_out, {{Projection::kO, tmp_, d}}));
    PREFT_RETURN_IF_ERROR(AllReduce(tmp_, T * d));
    PREFT_RETURN_IF_ERROR(Cuda(
        cuda::AddRmsNorm(x_, tmp_, l.post_attention_norm, T, d, eps, h_, stream_), "norm"));
    PREFT_RETURN_IF_ERROR(
        linear_shared(h_, T, d, {{l.gate, inter, nullptr, gate_}, {l.up, inter, nullptr, up_}}));
    PREFT_RETURN_IF_ERROR(apply_lora(li, h_, d,
                                     {{Projection::kGate, gate_, inter},
                                      {Projection::kUp, up_, inter}}));
    PREFT_RETURN_IF_ERROR(
        Cuda(cuda::SiluMulSeparate(gate_, up_, T * inter, gate_, stream_), "SwiGLU"));
    PREFT_RETURN_IF_ERROR(linear(gate_, T, l.down, d, inter, nullptr, tmp_));
    PREFT_RETURN_IF_ERROR(apply_lora(li, gate_, inter, {{Projection::kDown, tmp_, d}}));
    PREFT_RETURN_IF_ERROR(AllReduce(tmp_, T * d));
    mlp_out_pending = direft.empty();
    if (!direft.empty()) {
      PREFT_RETURN_IF_ERROR(Cuda(cuda::AddInPlace(x_, tmp_, T * d, stream_), "add"));
      cuda::LowRankTargets targets;
      targets.target[0] = {static_cast<int32_t>(DeviceAdapter::Entry(li, DeviceAdapter::kDireftSlot)),
                           x_, d};
      targets.num_targets = 1;
      PREFT_RETURN_IF_ERROR(direft.Launch(x_, d, targets, stream_));
    }
  }
  if (mlp_out_pending) {
    PREFT_RETURN_IF_ERROR(Cuda(cuda::AddInPlace(x_, tmp_, T * d, stream_), "add"));
  }
  // Only the rows that will be sampled go through the final norm and the LM head; only rank 0
  // (every rank holds the same residual stream) runs them.
  if (shard_.rank != 0) return absl::OkStatus();
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::GatherRows(x_, DType::kF32, d, logit_rows, R, last_, stream_), "gather"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::RmsNorm(last_, final_norm_, R, d, eps, last_, stream_), "norm"));
  return linear(last_, R, lm_head_, c.vocab_size, d, nullptr, logits_);
}

absl::Status DeviceModel::Forward(const ForwardBatch& batch, DeviceKvCache* cache,
                                  DeviceAdapterSlots* adapters,
                                  base::AlignedVector<float>* logits) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const size_t n = batch.logit_rows.size() * config_.vocab_size;
  logits->resize(n);
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::CopyToHost(logits->data(), logits_, n * sizeof(float), stream_), "copy"));
  return Cuda(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::ForwardRank(const ForwardBatch& batch, DeviceKvCache* cache,
                                      DeviceAdapterSlots* adapters) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  return Cuda(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::AllReduce(float* y, int64_t n) {
  if (collective_ == nullptr) return absl::OkStatus();
  if (const char* error = collective_->SumInPlace(y, n, stream_); error != nullptr) {
    return absl::InternalError(absl::StrCat("tensor-parallel all-reduce (", collective_->kind(),
                                            ", rank ", shard_.rank, "): ", error));
  }
  return absl::OkStatus();
}

void DeviceModel::ClearGraphs() {
  for (auto& [key, exec] : graphs_) cuda::GraphDestroy(exec);
  graphs_.clear();
}

absl::Status DeviceModel::Reserve(DeviceBuffer* buffer, size_t bytes) {
  if (buffer->size() >= bytes) return absl::OkStatus();
  PREFT_RETURN_IF_ERROR(Cuda(cuda::StreamSynchronize(stream_), "synchronize"));
  *buffer = DeviceBuffer();
  PREFT_ASSIGN_OR_RETURN(*buffer, DeviceBuffer::Allocate(std::max(bytes * 2, size_t{4096})));
  return absl::OkStatus();
}

absl::Status DeviceModel::ForwardSample(const ForwardBatch& batch, DeviceKvCache* cache,
                                        DeviceAdapterSlots* adapters,
                                        const std::vector<cuda::SampleSpec>& specs,
                                        std::vector<int32_t>* tokens) {
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  if (static_cast<int64_t>(specs.size()) != R) {
    const absl::Status refused = absl::InvalidArgumentError(
        absl::StrCat(specs.size(), " sampling specs for ", R, " logit rows"));
    // The other ranks run this step all the same: they learn of the refusal at its agreement.
    if (agree_) agree_(refused).IgnoreError();
    return refused;
  }
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const size_t specs_bytes = AlignUp(R * sizeof(cuda::SampleSpec));
  PREFT_RETURN_IF_ERROR(Reserve(&picks_, specs_bytes + R * sizeof(int32_t)));
  const size_t ws = cuda::SampleWorkspaceBytes(R, config_.vocab_size);
  PREFT_RETURN_IF_ERROR(Reserve(&sample_workspace_, ws));
  auto* d_specs = picks_.as<cuda::SampleSpec>();
  auto* d_tokens = picks_.as<int32_t>(specs_bytes);
  PREFT_RETURN_IF_ERROR(Cuda(cuda::CopyToDevice(d_specs, specs.data(),
                                                R * sizeof(cuda::SampleSpec), stream_),
                             "copy"));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::SampleRows(logits_, R, config_.vocab_size, d_specs, d_tokens,
                                               sample_workspace_.get(), sample_workspace_.size(),
                                               stream_),
                             "sampling"));
  tokens->resize(R);
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::CopyToHost(tokens->data(), d_tokens, R * sizeof(int32_t), stream_), "copy"));
  return Cuda(cuda::StreamSynchronize(stream_), "forward");
}

absl::Status DeviceModel::ForwardGreedy(const ForwardBatch& batch, DeviceKvCache* cache,
                                        DeviceAdapterSlots* adapters,
                                        std::vector<int32_t>* tokens,
                                        std::vector<float>* logprobs) {
  PREFT_RETURN_IF_ERROR(Run(batch, cache, adapters));
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  PREFT_RETURN_IF_ERROR(Reserve(&picks_, R * (sizeof(int32_t) + sizeof(float))));
  auto* d_tokens = picks_.as<int32_t>();
  auto* d_logprobs = picks_.as<float>(R * sizeof(int32_t));
  PREFT_RETURN_IF_ERROR(Cuda(cuda::GreedyLogprob(logits_, R, config_.vocab_size, d_tokens,
                                                 d_logprobs, stream_),
                             "greedy"));
  tokens->resize(R);
  logprobs->resize(R);
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::CopyToHost(tokens->data(), d_tokens, R * sizeof(int32_t), stream_), "copy"));
  PREFT_RETURN_IF_ERROR(
      Cuda(cuda::CopyToHost(logprobs->data(), d_logprobs, R * sizeof(float), stream_), "copy"));
  return Cuda(cuda::StreamSynchronize(stream_), "forward");
}

}  // namespace preft::model

#include "common/backend/device_kv_cache.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/runtime.cuh"

namespace preft::backend {
namespace {

namespace cuda = kernels::cuda;

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceKvCache>> DeviceKvCache::Create(
    const kv::KvCacheShape& shape) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  if (shape.num_layers <= 0 || shape.num_blocks <= 0 || shape.block_tokens <= 0 ||
      shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    return absl::InvalidArgumentError("KV cache shape must be positive in every dimension");
  }
  const size_t bytes = static_cast<size_t>(shape.num_blocks) * shape.bytes_per_block_all_layers();
  PREFT_ASSIGN_OR_RETURN(DeviceBuffer data, DeviceBuffer::Allocate(bytes));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::Memset(data.get(), 0, bytes, nullptr), "memset"));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize"));
  return std::unique_ptr<DeviceKvCache>(new DeviceKvCache(shape, std::move(data)));
}

absl::StatusOr<int64_t> DeviceKvCache::BlocksThatFit(const kv::KvCacheShape& shape,
                                                     double fraction, size_t reserve_bytes) {
  PREFT_RETURN_IF_ERROR(NeedDevice());
  if (!(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("fraction must be in (0, 1], got ", fraction));
  }
  size_t free_b = 0, total_b = 0;
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::MemoryInfo(&free_b, &total_b), "memory info"));
  free_b = free_b > reserve_bytes ? free_b - reserve_bytes : 0;
  return static_cast<int64_t>(static_cast<double>(free_b) * fraction /
                              static_cast<double>(shape.bytes_per_block_all_layers()));
}

absl::Status DeviceKvCache::CopyToHost(std::vector<float>* host) const {
  if (shape_.dtype != kv::KvDtype::kF32) {
    return absl::FailedPreconditionError("CopyToHost into floats needs an f32 KV cache");
  }
  host->resize(data_.size() / sizeof(float));
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::CopyToHost(host->data(), data_.get(), data_.size(), nullptr),
                             "copy to host"));
  return CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize");
}

namespace {

// InvalidArgument unless `host` has `device`'s shape (with every rank's KV heads) and every
// block is in range.
absl::Status CheckBlockCopy(const kv::KvCacheShape& device, const kv::KvCacheShape& host,
                            const std::vector<int32_t>& blocks, const TensorShard& shard) {
  if (host.num_layers != device.num_layers || host.num_blocks != device.num_blocks ||
      host.block_tokens != device.block_tokens ||
      host.num_kv_heads != device.num_kv_heads * shard.ranks || host.head_dim != device.head_dim ||
      host.dtype != device.dtype) {
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
// KvHeadCopies counts elements; `f` turns them into bytes.
absl::Status CopyKvHeads(char* device, char* host, const kv::KvCacheShape& full,
                         const TensorShard& shard, const std::vector<int32_t>& blocks,
                         bool to_host) {
  const size_t f = static_cast<size_t>(full.element_bytes());
  for (const StridedCopy& c : KvHeadCopies(full, shard, blocks)) {
    char* d = device + c.src_offset * f;
    char* h = host + c.dst_offset * f;
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
    PREFT_RETURN_IF_ERROR(CudaStatus(e, to_host ? "KV copy to host" : "KV copy to the device"));
  }
  return CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize");
}

}  // namespace

absl::Status DeviceKvCache::CopyBlocksToHost(const std::vector<int32_t>& blocks,
                                             kv::KvCache* host, const TensorShard& shard) const {
  PREFT_RETURN_IF_ERROR(CheckBlockCopy(shape_, host->shape(), blocks, shard));
  return CopyKvHeads(layer_data(0), reinterpret_cast<char*>(host->layer_data(0)), host->shape(),
                     shard, blocks, /*to_host=*/true);
}

absl::Status DeviceKvCache::CopyBlocksFromHost(const kv::KvCache& host,
                                               const std::vector<int32_t>& blocks,
                                               const TensorShard& shard) {
  PREFT_RETURN_IF_ERROR(CheckBlockCopy(shape_, host.shape(), blocks, shard));
  // Only read from: the copy goes to the device.
  char* from = const_cast<char*>(reinterpret_cast<const char*>(host.layer_data(0)));
  return CopyKvHeads(layer_data(0), from, host.shape(), shard, blocks, /*to_host=*/false);
}

absl::Status DeviceKvCache::PoisonForTesting() {
  PREFT_RETURN_IF_ERROR(CudaStatus(cuda::Memset(data_.get(), 0xff, data_.size(), nullptr), "memset"));
  return CudaStatus(cuda::StreamSynchronize(nullptr), "synchronize");
}

}  // namespace preft::backend

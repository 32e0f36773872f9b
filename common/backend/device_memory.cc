#include "common/backend/device_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/kernels/cuda/runtime.cuh"

namespace preft::backend {
namespace {

namespace cuda = kernels::cuda;

}  // namespace

absl::Status CudaStatus(int code, const char* what) {
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cuda::ErrorString(code)));
}

absl::Status NeedDevice() {
  if (cuda::DeviceCount() > 0) return absl::OkStatus();
  return absl::FailedPreconditionError("no CUDA device is visible");
}

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

}  // namespace preft::backend

#pragma once

// Device memory for the GPU forward (device_model.h and its parts): one allocation freed on
// destruction, the plan of an allocation's aligned offsets, and CUDA error codes as statuses.
// CUDA itself stays behind common/kernels/cuda.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace preft::backend {

// One device allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // ResourceExhausted (with the device's free memory) when cudaMalloc fails.
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  void* get() const { return ptr_; }
  template <class T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(ptr_) + byte_offset);
  }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// OK for CUDA's success code, else Internal naming `what` and CUDA's message.
absl::Status CudaStatus(int code, const char* what);
// FailedPrecondition when no CUDA device is visible.
absl::Status NeedDevice();

inline constexpr size_t kDeviceAlign = 256;
inline size_t AlignUp(size_t n, size_t a = kDeviceAlign) { return (n + a - 1) / a * a; }

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

// Uniform bound with standard deviation `std` (random weights for tests and benchmarks).
inline float UniformBound(double std) { return static_cast<float>(std * std::sqrt(3.0)); }

}  // namespace preft::backend

#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace preft::base {

// Allocates on a cache line. The CPU kernels write activations in 64-byte vectors; from a
// plain std::vector (whose large buffers start 16 bytes into a page) every such store splits
// two lines: measured ~9% of the AMX GEMM's time at m = 512.
template <class T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};

  CacheAlignedAllocator() = default;
  template <class U>
  CacheAlignedAllocator(const CacheAlignedAllocator<U>&) {}

  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t n) { ::operator delete(p, n * sizeof(T), kAlign); }

  template <class U>
  bool operator==(const CacheAlignedAllocator<U>&) const {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheAlignedAllocator<T>>;

}  // namespace preft::base

#pragma once

// The all-reduce of tensor parallelism: each rank's partial output of a row-parallel layer is
// summed over the ranks, in place, on the rank's stream. Two kinds of group:
// - ranks on distinct devices (the deployment): NCCL. libnccl.so.2 is loaded when such a group
//   is made (as vLLM's pynccl does), not linked: a single-GPU build, and the GPU bundle, carry
//   none of its 200 MB.
// - ranks sharing one device in one process (so that a single lent GPU checks the sharding
//   itself): the ranks meet at a host barrier and each sums every rank's part in rank order.
//   Synchronous, so never recorded into a CUDA graph.
// Every rank must make the same calls in the same order (as with NCCL): a call one rank
// skips leaves the others waiting. Each rank's calls come from its own thread, with its
// device current.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace preft::kernels::cuda {

class Collective {
 public:
  virtual ~Collective() = default;
  // buf[0 .. n) = the sum over the ranks of their buf[0 .. n), queued on `stream`. Null on
  // success, else what failed (static text).
  virtual const char* SumInPlace(float* buf, int64_t n, void* stream) = 0;
  // Whether SumInPlace may be captured into a CUDA graph.
  virtual bool capturable() const = 0;
  // "nccl" or "shared-device".
  virtual const char* kind() const = 0;
};

// One Collective per rank, rank r on devices[r]: NCCL when the devices are distinct, the
// shared-device group when they are all the same. An empty string on success, else why not
// (NCCL missing or failing, a mix of shared and distinct devices).
std::string MakeCollectives(const std::vector<int>& devices,
                            std::vector<std::unique_ptr<Collective>>* ranks);

}  // namespace preft::kernels::cuda

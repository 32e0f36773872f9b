#include "common/kernels/cuda/collectives.cuh"

#include <cuda_runtime.h>
#include <dlfcn.h>
#ifdef PREFT_HAVE_NCCL_H
#include <nccl.h>
#endif

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <set>
#include <type_traits>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

// ---- NCCL, loaded at run time ----
#ifdef PREFT_HAVE_NCCL_H

struct NcclApi {
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

// The process's NCCL, loaded once; null with *error set when it cannot be.
const NcclApi* LoadNccl(std::string* error) {
  static std::string load_error;
  static const NcclApi* api = [&]() -> const NcclApi* {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      load_error = std::string("cannot load NCCL (libnccl.so.2): ") + dlerror();
      return nullptr;
    }
    auto* a = new NcclApi;
    bool ok = true;
    auto bind = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      if (*fn == nullptr) {
        load_error = std::string("NCCL (libnccl.so.2) has no ") + name;
        ok = false;
      }
    };
    bind(&a->comm_init_all, "ncclCommInitAll");
    bind(&a->comm_destroy, "ncclCommDestroy");
    bind(&a->all_reduce, "ncclAllReduce");
    bind(&a->error_string, "ncclGetErrorString");
    if (!ok) {
      delete a;
      return nullptr;
    }
    return a;
  }();
  if (api == nullptr) *error = load_error;
  return api;
}

class NcclRank : public Collective {
 public:
  NcclRank(const NcclApi* api, ncclComm_t comm) : api_(api), comm_(comm) {}
  ~NcclRank() override { api_->comm_destroy(comm_); }
  const char* SumInPlace(float* buf, int64_t n, void* stream) override {
    const ncclResult_t r = api_->all_reduce(buf, buf, static_cast<size_t>(n), ncclFloat32, ncclSum,
                                            comm_, AsStream(stream));
    return r == ncclSuccess ? nullptr : api_->error_string(r);
  }
  bool capturable() const override { return true; }
  const char* kind() const override { return "nccl"; }

 private:
  const NcclApi* api_;
  ncclComm_t comm_;
};

// Ranks on distinct devices, one NCCL communicator each.
std::string MakeNcclRanks(const std::vector<int>& devices,
                          std::vector<std::unique_ptr<Collective>>* ranks) {
  std::string error;
  const NcclApi* api = LoadNccl(&error);
  if (api == nullptr) return error;
  std::vector<ncclComm_t> comms(devices.size());
  const ncclResult_t r =
      api->comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data());
  if (r != ncclSuccess) return std::string("ncclCommInitAll: ") + api->error_string(r);
  for (ncclComm_t c : comms) ranks->push_back(std::make_unique<NcclRank>(api, c));
  return "";
}
#else
std::string MakeNcclRanks(const std::vector<int>&, std::vector<std::unique_ptr<Collective>>*) {
  return "this build has no NCCL header (nccl.h): ranks on distinct devices need NCCL";
}
#endif  // PREFT_HAVE_NCCL_H

// ---- Ranks sharing one device ----

constexpr int kMaxSharedRanks = 8;

struct Parts {
  const float* part[kMaxSharedRanks];
};

// out[i] = the sum of every rank's part[i], in rank order (so every rank gets the same bits).
__global__ void SumPartsKernel(Parts parts, int ranks, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = parts.part[0][i];
    for (int r = 1; r < ranks; ++r) s += parts.part[r][i];
    out[i] = s;
  }
}

// What the ranks of one shared-device group meet at.
class SharedGroup {
 public:
  explicit SharedGroup(int ranks) : ranks_(ranks) {}
  int ranks() const { return ranks_; }
  Parts& parts() { return parts_; }
  // Blocks until every rank has arrived (a reusable, generation-counted barrier).
  void Barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  const int ranks_;
  Parts parts_{};  // written by each rank before the first barrier, read after it
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

class SharedDeviceRank : public Collective {
 public:
  SharedDeviceRank(std::shared_ptr<SharedGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  ~SharedDeviceRank() override {
    if (sum_ != nullptr) cudaFree(sum_);
  }
  // Every part is complete (each rank synchronised its stream) before any rank reads it, and
  // read by all (the second barrier) before any rank overwrites its own with the sum.
  const char* SumInPlace(float* buf, int64_t n, void* stream) override {
    cudaStream_t s = AsStream(stream);
    if (n > capacity_) {
      if (sum_ != nullptr) cudaFree(sum_);
      sum_ = nullptr;
      capacity_ = 0;
      if (cudaMalloc(&sum_, n * sizeof(float)) != cudaSuccess) return "cannot allocate the sum";
      capacity_ = n;
    }
    const cudaError_t ready = cudaStreamSynchronize(s);
    group_->parts().part[rank_] = buf;
    group_->Barrier();
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));
    if (n > 0) SumPartsKernel<<<blocks, 256, 0, s>>>(group_->parts(), group_->ranks(), n, sum_);
    const cudaError_t summed = cudaStreamSynchronize(s);
    group_->Barrier();
    if (ready != cudaSuccess) return cudaGetErrorString(ready);
    if (summed != cudaSuccess) return cudaGetErrorString(summed);
    if (cudaMemcpyAsync(buf, sum_, n * sizeof(float), cudaMemcpyDeviceToDevice, s) != cudaSuccess) {
      return "copying the sum back failed";
    }
    return nullptr;
  }
  bool capturable() const override { return false; }
  const char* kind() const override { return "shared-device"; }

 private:
  std::shared_ptr<SharedGroup> group_;
  const int rank_;
  float* sum_ = nullptr;
  int64_t capacity_ = 0;
};

}  // namespace

std::string MakeCollectives(const std::vector<int>& devices,
                            std::vector<std::unique_ptr<Collective>>* ranks) {
  ranks->clear();
  const int n = static_cast<int>(devices.size());
  if (n < 1) return "a collective group needs at least one rank";
  const std::set<int> distinct(devices.begin(), devices.end());
  if (distinct.size() == 1 && n > 1) {
    if (n > kMaxSharedRanks) {
      return "at most " + std::to_string(kMaxSharedRanks) + " ranks may share one device";
    }
    auto group = std::make_shared<SharedGroup>(n);
    for (int r = 0; r < n; ++r) ranks->push_back(std::make_unique<SharedDeviceRank>(group, r));
    return "";
  }
  if (static_cast<int>(distinct.size()) != n) {
    return "tensor-parallel ranks must each have a device of their own, or all share one";
  }
  return MakeNcclRanks(devices, ranks);
}

}  // namespace preft::kernels::cuda

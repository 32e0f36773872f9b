#pragma once

// Adapters in device memory for the GPU forward: each adapter's matrices and pair table, a
// thread that stages and copies them off the forward's thread, and the slots (a byte budget,
// least recently used out) that batches' adapters live in.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/backend/device_memory.h"
#include "common/backend/tensor_parallel.h"
#include "common/base/step_lru.h"
#include "common/kernels/cuda/low_rank.cuh"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::backend {

// Where adapter uploads stage their bytes: one page-locked buffer and a stream of their own,
// so a copy runs while the device computes, and the host's part is one memcpy (a copy from
// pageable memory is staged by the driver and blocks). Not thread-safe (AdapterUploader's
// thread owns one).
class UploadStage {
 public:
  static absl::StatusOr<std::unique_ptr<UploadStage>> Create();
  ~UploadStage();
  UploadStage(const UploadStage&) = delete;
  UploadStage& operator=(const UploadStage&) = delete;

  // The staging buffer, at least `bytes`, once the previous copy out of it is done.
  absl::StatusOr<uint8_t*> Buffer(size_t bytes);
  // Queues the copy of the buffer's first `bytes` to `dst` and records `done` after it.
  absl::Status Copy(void* dst, size_t bytes, void* done);

 private:
  UploadStage() = default;
  void* stream_ = nullptr;
  void* copied_ = nullptr;  // event: the last copy out of pinned_ is done
  uint8_t* pinned_ = nullptr;
  size_t size_ = 0;
};

// One adapter in device memory: its matrices and a table of pairs, kEntriesPerLayer per layer
// (the seven LoRA projections, then the DiReFT update), that the low-rank kernel indexes.
class DeviceAdapter {
 public:
  ~DeviceAdapter();
  static constexpr int kEntriesPerLayer = model::kNumProjections + 1;
  static constexpr int64_t Entry(int64_t layer, int slot) { return layer * kEntriesPerLayer + slot; }
  static constexpr int kDireftSlot = model::kNumProjections;

  // Device memory for `a` (the part of it tensor-parallel rank `shard` holds) and where each
  // piece goes, nothing copied yet. InvalidArgument for a rank over
  // kernels::cuda::kMaxLowRank or matrices of mixed dtypes.
  static absl::StatusOr<std::unique_ptr<DeviceAdapter>> Allocate(const model::AdapterWeights& a,
                                                                const TensorShard& shard = {});
  // Stages `a` (the adapter Allocate planned) in `stage` and queues its copy there;
  // ready_event() then marks the copy's end (a stream that reads the adapter waits on it).
  absl::Status Stage(const model::AdapterWeights& a, UploadStage* stage);
  // Random bf16 matrices made on the device (benchmarks: 512 adapters of an 8B model without
  // writing them): LoRA of `rank` on all seven projections of every layer, scale 1, or DiReFT
  // of `rank` on every layer. `config` is the rank's own (ShardConfig) under tensor parallelism.
  static absl::StatusOr<std::unique_ptr<DeviceAdapter>> Random(const model::ModelConfig& config,
                                                              model::AdapterKind kind, int64_t rank,
                                                              uint64_t seed);

  model::AdapterKind kind() const { return kind_; }
  const kernels::cuda::LowRankPair* table() const { return table_; }  // device
  size_t bytes() const { return data_.size(); }
  int64_t max_rank() const { return max_rank_; }
  // The event recorded after a staged upload's copy (a cudaEvent_t); null when none is due.
  void* ready_event() const { return ready_; }

 private:
  struct Placed {
    size_t shrink = 0, expand = 0, bias = 0;
    LowRankSlice slice;  // the part of the pair this rank holds
  };
  DeviceAdapter() = default;
  // The matrices, biases and table (with device addresses) as they are laid out on the device.
  void Fill(const model::AdapterWeights& a, uint8_t* staging) const;

  void* ready_ = nullptr;
  std::vector<Placed> placed_;  // per table entry (Allocate's plan)
  size_t table_at_ = 0;
  model::AdapterKind kind_ = model::AdapterKind::kLora;
  DeviceBuffer data_;  // matrices, biases, then the table
  const kernels::cuda::LowRankPair* table_ = nullptr;
  int64_t max_rank_ = 0;
};

// Stages adapters and queues their copies on a thread of its own, so neither the memcpy into
// page-locked memory nor a wait for the staging buffer holds the thread that runs the steps.
// Enqueue, Queued and Wait are for one caller thread (DeviceAdapterSlots').
class AdapterUploader {
 public:
  static absl::StatusOr<std::unique_ptr<AdapterUploader>> Create();
  ~AdapterUploader();  // queued jobs finish first
  AdapterUploader(const AdapterUploader&) = delete;
  AdapterUploader& operator=(const AdapterUploader&) = delete;

  // Queues the copy of `host` into `dst` (from DeviceAdapter::Allocate; it must outlive the
  // job: call Wait before destroying it). `host` is held until staged.
  void Enqueue(std::shared_ptr<const model::AdapterWeights> host, DeviceAdapter* dst);
  // True once dst's copy is on the upload stream (or failed); never blocks.
  bool Queued(const DeviceAdapter* dst);
  // Blocks until dst's copy is on the upload stream; the staging's status.
  absl::Status Wait(const DeviceAdapter* dst);

 private:
  struct Job {
    std::shared_ptr<const model::AdapterWeights> host;
    DeviceAdapter* dst;
  };
  AdapterUploader() = default;
  void Run();

  int device_ = 0;  // the creator's current device: thread_ works on it
  std::unique_ptr<UploadStage> stage_;  // used by thread_ alone
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  absl::flat_hash_set<const DeviceAdapter*> pending_;  // queued or being staged
  absl::flat_hash_map<const DeviceAdapter*, absl::Status> failed_;
  bool stop_ = false;
  std::thread thread_;
};

// The device copies of the adapters batches name: uploaded on first use into a byte budget,
// least recently used copies dropped to make room, never one the current step uses (a step's
// adapters may together exceed the budget; it holds again as later steps make room). Keyed by
// the host weights' serial, not their address, so an adapter freed on the host and another
// allocated at its address never share a copy. Not thread-safe (the forward's thread).
class DeviceAdapterSlots {
 public:
  // Under tensor parallelism each rank keeps its own slots, holding its part of each adapter.
  explicit DeviceAdapterSlots(size_t budget_bytes = base::StepLru::kNoBudget,
                              const TensorShard& shard = {})
      : lru_(budget_bytes), shard_(shard) {}

  // Starts a forward step over the distinct adapters in `used`: copies used only before it
  // may now be dropped, and those of `used` already here are pinned first, so making room
  // for the step's missing ones never drops another one the step needs.
  void BeginStep(const std::vector<const model::AdapterWeights*>& used);
  // The device copy of `host`, uploaded (after making room) when absent. ResourceExhausted
  // when the device has no memory left even after dropping every copy outside this step.
  // The copy is queued on a stream of its own (by the time this returns): a stream that
  // reads it must first wait on its ready_event() (DeviceModel's forward does).
  absl::StatusOr<const DeviceAdapter*> Get(const model::AdapterWeights* host);
  // Starts the upload of `host` (a request naming it was queued) and returns at once: the
  // copy overlaps the steps before its first use. Errors are left for that step's Get.
  void Prefetch(std::shared_ptr<const model::AdapterWeights> host);
  // Whether a step naming `host` would run without waiting for its copy: true once the copy
  // is on the device. Starts the upload when absent; the upload's error when it failed (the
  // slot is dropped, so a later call tries again). Never blocks.
  absl::StatusOr<bool> Ready(const std::shared_ptr<const model::AdapterWeights>& host);
  // Makes `key` resolve to an adapter built on the device (benchmarks).
  void Put(const model::AdapterWeights* key, std::unique_ptr<DeviceAdapter> adapter);
  void Evict(const model::AdapterWeights* host);

  size_t size() const { return slots_.size(); }
  size_t bytes() const { return lru_.bytes(); }
  size_t budget() const { return lru_.budget(); }
  int64_t uploads() const { return uploads_; }
  int64_t evictions() const { return evictions_; }

 private:
  // Allocates `host`'s slot (after making room) and queues its copy.
  absl::StatusOr<DeviceAdapter*> StartUpload(std::shared_ptr<const model::AdapterWeights> host);
  void Drop(const std::vector<uint64_t>& serials);
  void Erase(uint64_t serial);  // after its copy is queued, so no job writes freed memory

  base::StepLru lru_;
  TensorShard shard_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<DeviceAdapter>> slots_;
  // Made at the first upload (it needs a device); declared after slots_, so it finishes its
  // jobs (which write into slots_' adapters) before they are freed.
  std::unique_ptr<AdapterUploader> uploader_;
  int64_t uploads_ = 0;
  int64_t evictions_ = 0;
};

// The pair in table entry (layer, slot) of `a`, or null when that entry is unused.
const model::LowRank* PairOf(const model::AdapterWeights& a, int64_t layer, int slot);

}  // namespace preft::backend

#pragma once

// The model forward on an NVIDIA GPU: the same ForwardBatch as Model::Forward, over weights
// copied to device memory (bf16), a paged KV cache in device memory with the CPU cache's
// layout (common/kernels/attention_types.h), and adapters uploaded to device slots. Built only
// with PREFT_ENABLE_CUDA; CUDA itself stays behind common/kernels/cuda (streams are void*).

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
#include "common/base/aligned_vector.h"
#include "common/base/step_lru.h"
#include "common/kernels/attention_types.h"
#include "common/kernels/cuda/collectives.cuh"
#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/low_rank.cuh"
#include "common/kernels/cuda/sampling.cuh"
#include "common/kv/kv_cache.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"
#include "common/model/forward_batch.h"
#include "common/model/model.h"
#include "common/model/tensor_parallel.h"

namespace preft::model {

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

// A paged KV cache in device memory: kv::KvCache's layout ([layer][block][K|V]...), f32.
class DeviceKvCache {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKvCache>> Create(const kv::KvCacheShape& shape);
  // The number of blocks of `shape` (its num_blocks ignored) that fit in `fraction` of the
  // device's free memory now, less `reserve_bytes` kept for other uses (adapter slots): how a
  // serving process sizes its pool after loading weights.
  static absl::StatusOr<int64_t> BlocksThatFit(const kv::KvCacheShape& shape, double fraction,
                                               size_t reserve_bytes = 0);

  const kv::KvCacheShape& shape() const { return shape_; }
  float* layer_base(int64_t layer) const {
    return data_.as<float>() + layer * shape_.num_blocks * shape_.block_floats();
  }
  int64_t v_offset() const { return shape_.num_kv_heads * shape_.block_tokens * shape_.head_dim; }
  // Copies the whole cache to `host` (resized): tests compare it with the CPU cache.
  absl::Status CopyToHost(std::vector<float>* host) const;
  // Copies `blocks` (every layer) to or from a host cache of the same shape (a host mirror the
  // KV transport reads and writes); for tensor-parallel rank `shard`, whose cache holds its KV
  // heads only, into or out of its heads' place in a host cache of every head.
  // InvalidArgument for another shape or a block out of range.
  absl::Status CopyBlocksToHost(const std::vector<int32_t>& blocks, kv::KvCache* host,
                                const TensorShard& shard = {}) const;
  absl::Status CopyBlocksFromHost(const kv::KvCache& host, const std::vector<int32_t>& blocks,
                                  const TensorShard& shard = {});
  // Sets every byte to 0xff (NaN), so a test sees any value the forward should have written.
  absl::Status PoisonForTesting();

 private:
  DeviceKvCache(const kv::KvCacheShape& shape, DeviceBuffer data)
      : shape_(shape), data_(std::move(data)) {}
  kv::KvCacheShape shape_;
  DeviceBuffer data_;
};

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
  static constexpr int kEntriesPerLayer = kNumProjections + 1;
  static constexpr int64_t Entry(int64_t layer, int slot) { return layer * kEntriesPerLayer + slot; }
  static constexpr int kDireftSlot = kNumProjections;

  // Device memory for `a` (the part of it tensor-parallel rank `shard` holds) and where each
  // piece goes, nothing copied yet. InvalidArgument for a rank over
  // kernels::cuda::kMaxLowRank or matrices of mixed dtypes.
  static absl::StatusOr<std::unique_ptr<DeviceAdapter>> Allocate(const AdapterWeights& a,
                                                                const TensorShard& shard = {});
  // Stages `a` (the adapter Allocate planned) in `stage` and queues its copy there;
  // ready_event() then marks the copy's end (a stream that reads the adapter waits on it).
  absl::Status Stage(const AdapterWeights& a, UploadStage* stage);
  // Random bf16 matrices made on the device (benchmarks: 512 adapters of an 8B model without
  // writing them): LoRA of `rank` on all seven projections of every layer, scale 1, or DiReFT
  // of `rank` on every layer. `config` is the rank's own (ShardConfig) under tensor parallelism.
  static absl::StatusOr<std::unique_ptr<DeviceAdapter>> Random(const ModelConfig& config,
                                                              AdapterKind kind, int64_t rank,
                                                              uint64_t seed);

  AdapterKind kind() const { return kind_; }
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
  void Fill(const AdapterWeights& a, uint8_t* staging) const;

  void* ready_ = nullptr;
  std::vector<Placed> placed_;  // per table entry (Allocate's plan)
  size_t table_at_ = 0;
  AdapterKind kind_ = AdapterKind::kLora;
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
  void Enqueue(std::shared_ptr<const AdapterWeights> host, DeviceAdapter* dst);
  // True once dst's copy is on the upload stream (or failed); never blocks.
  bool Queued(const DeviceAdapter* dst);
  // Blocks until dst's copy is on the upload stream; the staging's status.
  absl::Status Wait(const DeviceAdapter* dst);

 private:
  struct Job {
    std::shared_ptr<const AdapterWeights> host;
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
  void BeginStep(const std::vector<const AdapterWeights*>& used);
  // The device copy of `host`, uploaded (after making room) when absent. ResourceExhausted
  // when the device has no memory left even after dropping every copy outside this step.
  // The copy is queued on a stream of its own (by the time this returns): a stream that
  // reads it must first wait on its ready_event() (DeviceModel's forward does).
  absl::StatusOr<const DeviceAdapter*> Get(const AdapterWeights* host);
  // Starts the upload of `host` (a request naming it was queued) and returns at once: the
  // copy overlaps the steps before its first use. Errors are left for that step's Get.
  void Prefetch(std::shared_ptr<const AdapterWeights> host);
  // Whether a step naming `host` would run without waiting for its copy: true once the copy
  // is on the device. Starts the upload when absent; the upload's error when it failed (the
  // slot is dropped, so a later call tries again). Never blocks.
  absl::StatusOr<bool> Ready(const std::shared_ptr<const AdapterWeights>& host);
  // Makes `key` resolve to an adapter built on the device (benchmarks).
  void Put(const AdapterWeights* key, std::unique_ptr<DeviceAdapter> adapter);
  void Evict(const AdapterWeights* host);

  size_t size() const { return slots_.size(); }
  size_t bytes() const { return lru_.bytes(); }
  size_t budget() const { return lru_.budget(); }
  int64_t uploads() const { return uploads_; }
  int64_t evictions() const { return evictions_; }

 private:
  // Allocates `host`'s slot (after making room) and queues its copy.
  absl::StatusOr<DeviceAdapter*> StartUpload(std::shared_ptr<const AdapterWeights> host);
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

// Owned by one thread (Forward reuses device scratch; not thread-safe), on the device that
// was current when it was made. Runs on its own stream; every call returns after its results
// are on the host.
//
// Under tensor parallelism (common/model/tensor_parallel.h) a DeviceModel is one rank: it holds
// its slice of the weights, its heads' KV cache (CacheShape) and its part of each adapter
// (its DeviceAdapterSlots), and sums the partial outputs of o and down over the ranks through
// `collective`. Every rank runs every step (rank 0 through Forward*, which computes the LM
// head and returns results; the others through ForwardRank), each from its own thread.
class DeviceModel {
 public:
  // Copies the host model's weights (matrices as bf16, converting f32/f16 ones; norms and
  // biases f32): all of them, or rank `shard`'s slice (then `collective` is the rank's).
  // FailedPrecondition without a CUDA device.
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Upload(
      const Model& host, const TensorShard& shard = {},
      kernels::cuda::Collective* collective = nullptr);
  // Random bf16 weights in `config`'s shapes and make-model's scales, made on the device (a
  // rank's slice: its own random values in the slice's shape).
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Random(
      const ModelConfig& config, uint64_t seed, const TensorShard& shard = {},
      kernels::cuda::Collective* collective = nullptr);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  const ModelConfig& config() const { return full_config_; }  // the whole model's
  const TensorShard& shard() const { return shard_; }
  size_t weight_bytes() const { return weights_.size(); }
  // The shape of this rank's cache: its own KV heads.
  kv::KvCacheShape CacheShape(int64_t num_blocks, int64_t block_tokens = 16) const;

  // As Model::Forward: K/V of the new tokens into `cache`, the logits of batch.logit_rows
  // into `logits` ([rows, vocab]); adapters resolved through `adapters`.
  absl::Status Forward(const ForwardBatch& batch, DeviceKvCache* cache,
                       DeviceAdapterSlots* adapters, base::AlignedVector<float>* logits);
  // The same forward, but only the greedy token of each logit row and its logprob come back.
  absl::Status ForwardGreedy(const ForwardBatch& batch, DeviceKvCache* cache,
                             DeviceAdapterSlots* adapters, std::vector<int32_t>* tokens,
                             std::vector<float>* logprobs);

  // The same forward, then each logit row sampled on the device with specs[row] (the CPU
  // sampler's choice for the same seed and step); only the tokens come back.
  absl::Status ForwardSample(const ForwardBatch& batch, DeviceKvCache* cache,
                             DeviceAdapterSlots* adapters,
                             const std::vector<kernels::cuda::SampleSpec>& specs,
                             std::vector<int32_t>* tokens);

  // A step on a rank other than 0: its share of the layers (no LM head), nothing returned.
  absl::Status ForwardRank(const ForwardBatch& batch, DeviceKvCache* cache,
                           DeviceAdapterSlots* adapters);
  // Tensor-parallel ranks: every step, once this rank has prepared it (or failed to) and
  // before any collective, `agree` is given that status and returns the step's: an error if
  // any rank failed. So a rank that cannot run a step (no device memory for an adapter) fails
  // it on every rank instead of leaving the others waiting in an all-reduce.
  void SetStepAgreement(std::function<absl::Status(const absl::Status&)> agree) {
    agree_ = std::move(agree);
  }

  // Decode steps (one new token per sequence) record a CUDA graph per shape and replay it,
  // one launch instead of ~13 per layer (not with a collective that cannot be captured).
  // Off by default.
  void UseGraphs(bool on) { use_graphs_ = on; }
  // Decode graphs recorded so far (each costs a capture and an instantiation on the host).
  int64_t graph_captures() const { return graph_captures_; }

  // From now on every forward first fills its device scratch with 0xff (NaN), so a test sees
  // any value a kernel should have written and did not.
  void PoisonScratchForTesting() { poison_scratch_ = true; }

 private:
  struct DeviceLayer {
    const uint16_t *q, *k, *v, *o, *gate, *up, *down;
    const float *q_bias, *k_bias, *v_bias, *o_bias;  // null without attention bias
    const float *input_norm, *post_attention_norm;
  };
  // The metadata of one forward, in one host buffer copied to the device at once.
  struct Meta;
  class LowRankWork;
  // One forward's shape and the device addresses of its metadata.
  struct Step {
    int64_t tokens, rows, seqs, max_new;
    const int32_t* token_ids;
    const int32_t* positions;
    const int64_t* slots;
    const int32_t* logit_rows;
    const kernels::AttentionSeq* attention;
  };
  static constexpr size_t kMaxGraphs = 64;

  DeviceModel() = default;
  // `config` is the whole model's; the rank's slice is planned.
  absl::Status Init(const ModelConfig& config, const TensorShard& shard,
                    kernels::cuda::Collective* collective);
  // Sums a row-parallel layer's partial output over the ranks (nothing with one rank).
  absl::Status AllReduce(float* y, int64_t n);
  // Runs the layers and the LM head; leaves [rows, vocab] logits in logits_ on the device.
  // Takes part in the step's agreement exactly once, whether or not the step was prepared.
  absl::Status Run(const ForwardBatch& batch, DeviceKvCache* cache,
                   DeviceAdapterSlots* adapters);
  // Run's work: `agree` is called with OK once the step is prepared (every fallible host-side
  // check, adapter copy and allocation done), before its first kernel; a step that fails
  // before then returns without calling it.
  absl::Status RunStep(const ForwardBatch& batch, DeviceKvCache* cache,
                       DeviceAdapterSlots* adapters,
                       const std::function<absl::Status(absl::Status)>& agree);
  // Queues the kernels of one planned step on the stream (or into a graph being captured).
  absl::Status Launch(const Step& step, DeviceKvCache* cache, const LowRankWork& lora,
                      const LowRankWork& direft);
  void ClearGraphs();
  absl::Status EnsureScratch(int64_t tokens, int64_t rows);
  // Grows `buffer` to at least `bytes` (after the stream's work that may still read it).
  absl::Status Reserve(DeviceBuffer* buffer, size_t bytes);

  ModelConfig full_config_;
  ModelConfig config_;  // this rank's slice (ShardConfig): what the kernels run
  TensorShard shard_;
  kernels::cuda::Collective* collective_ = nullptr;  // borrowed; null with one rank
  std::function<absl::Status(const absl::Status&)> agree_;  // tensor-parallel ranks only
  void* stream_ = nullptr;
  kernels::cuda::Blas* blas_ = nullptr;
  DeviceBuffer weights_;  // every matrix (bf16), then norms, biases and inv_freq (f32)
  const uint16_t* embed_ = nullptr;
  const uint16_t* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* inv_freq_ = nullptr;
  std::vector<DeviceLayer> layers_;

  // Scratch, grown on demand.
  DeviceBuffer scratch_;
  int64_t scratch_tokens_ = 0, scratch_rows_ = 0;
  float *x_ = nullptr, *h_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr,
        *attn_ = nullptr, *tmp_ = nullptr, *gate_ = nullptr, *up_ = nullptr, *last_ = nullptr,
        *logits_ = nullptr;
  DeviceBuffer meta_;
  std::vector<uint8_t> meta_host_;
  DeviceBuffer picks_;  // greedy tokens and logprobs; or sample specs and tokens
  DeviceBuffer sample_workspace_;
  DeviceBuffer attention_parts_;  // the decode attention's split partials
  bool poison_scratch_ = false;
  bool use_graphs_ = false;
  std::map<std::vector<int64_t>, void*> graphs_;  // shape key -> cudaGraphExec_t
  int64_t graphs_blas_generation_ = -1;
  int64_t graph_captures_ = 0;
};

}  // namespace preft::model

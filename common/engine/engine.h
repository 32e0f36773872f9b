#pragma once

// The engine: requests in, tokens out, one forward per Step over a continuously batched
// set of sequences on a paged KV cache.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/backend/forward_backend.h"
#include "common/base/aligned_vector.h"
#include "common/engine/engine_observer.h"
#include "common/engine/request.h"
#include "common/engine/scheduler.h"
#include "common/kv/block_allocator.h"
#include "common/kv/kv_cache.h"
#include "common/model/forward_batch.h"
#include "common/model/model.h"
#include "common/text/tokenizer.h"

namespace preft::engine {

struct EngineOptions {
  int64_t kv_blocks = 0;  // 0: derive from kv_bytes
  int64_t kv_bytes = int64_t{1} << 30;
  // How the CPU cache stores K and V (f32 keeps the exact f32 references; bf16 halves the bytes).
  kv::KvDtype kv_dtype = kv::KvDtype::kF32;
  SchedulerConfig scheduler;
  int num_threads = 0;  // compute threads; 0: all cores
  // Prefix caching (prefix_cache.h): full blocks stay cached by content after their sequence
  // ends, and a new sequence's prompt starts after the longest cached run of its blocks.
  bool prefix_caching = true;
  int64_t max_cached_blocks = 0;  // 0: any block may stay cached (evicted only when needed)
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  // Prefix caching: prompt tokens looked up at admission, and of those found cached.
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
};

// Owned and driven by one thread (the engine thread); not thread-safe. Borrows the model
// and tokenizer (tokenizer may be null: then no text and no stop strings).
class Engine {
 public:
  // On the CPU: the model's forward over a host KV cache sized by `options`.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(model::Model* model,
                                                        const text::Tokenizer* tokenizer,
                                                        const EngineOptions& options);
  // Over any backend (a GPU's: backend::CudaBackend); options' KV sizes are the backend's
  // business and ignored here.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      std::unique_ptr<backend::ForwardBackend> backend, const text::Tokenizer* tokenizer,
      const EngineOptions& options);
  ~Engine();

  // Validates and queues. InvalidArgument for bad params/ids, or a prompt longer than the
  // model's context; an id already in use is AlreadyExists.
  absl::Status Add(Request request);
  // Finishes the request with kAbort (NotFound if unknown or already done).
  absl::Status Abort(const std::string& request_id);

  // Ends every active request with kError and `status` (the engine thread hit an error it
  // cannot recover from, or the worker is shutting down).
  void FailAll(const absl::Status& status);

  // Disaggregated serving. Decode tier: blocks a peer writes a prompt's KV into, later handed
  // to Add in Request::imported (or given back with FreeBlocks). ResourceExhausted if not free.
  absl::StatusOr<std::vector<int32_t>> ReserveBlocks(int64_t n);
  void FreeBlocks(const std::vector<int32_t>& blocks);
  // Prefill tier: frees the blocks a prefill-only request kept (after its KV was sent).
  // NotFound if none are held under that id.
  absl::Status ReleasePrefilled(const std::string& request_id);
  int64_t num_prefilled_held() const { return static_cast<int64_t>(prefilled_.size()); }
  // The KV cache in host memory (what the KV transport moves); null on a GPU backend.
  kv::KvCache* cache() { return backend_->host_cache(); }
  const model::ModelConfig& config() const { return backend_->config(); }
  // Sequences run at once (SchedulerConfig::max_running); more wait.
  int64_t max_running() const { return options_.scheduler.max_running; }
  const backend::ForwardBackend& backend() const { return *backend_; }
  backend::ForwardBackend& backend() { return *backend_; }

  bool HasWork() const {
    return !running_.empty() || !waiting_.empty() || !importing_.empty();
  }
  // Schedules and runs one forward, samples, emits events, retires finished requests.
  absl::Status Step();

  // Runs `requests` to completion and returns their results in the same order.
  absl::StatusOr<std::vector<GenerationResult>> Generate(std::vector<Request> requests);

  const EngineStats& stats() const { return stats_; }
  // Told about every step and every request's end (metrics); borrowed, may be null. Set it
  // before the engine runs.
  void set_observer(EngineObserver* observer) { observer_ = observer; }
  const kv::BlockAllocator& allocator() const { return allocator_; }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }

 private:
  struct Sequence;

  Engine(std::unique_ptr<backend::ForwardBackend> backend, const text::Tokenizer* tokenizer,
         const EngineOptions& options);
  void Finish(std::unique_ptr<Sequence>& seq, FinishReason reason, absl::Status status);
  // Appends a sampled token and emits its event; returns why the sequence is done (kNone:
  // it goes on).
  // `logprob` is used as given when set (an imported first token), else computed from `logits`.
  FinishReason AppendToken(Sequence& seq, int32_t token, const float* logits,
                           const std::optional<TokenLogprob>& logprob = std::nullopt);
  absl::Status AddImported(std::unique_ptr<Sequence> seq);
  // Whether `seq`'s adapter can be used now (no adapter: yes), asking the backend until it
  // says so (which starts the copy); the backend's error when it cannot be prepared.
  absl::StatusOr<bool> AdapterReadyFor(Sequence& seq);
  void HandOverPrefilled(std::unique_ptr<Sequence>& seq, int32_t token, const float* logits);
  void Preempt(Sequence& seq);
  // Prefix caching: how many leading blocks of a waiting sequence are cached (always leaving
  // a token to compute, whose logits it samples from), holds them for it when it is admitted,
  // and gives the blocks its forward filled their content addresses.
  bool UsesPrefixCache(const Sequence& seq) const;
  int64_t CachedPrefixBlocks(Sequence& seq);
  void TakeCachedPrefix(Sequence& seq);
  void PublishFullBlocks(Sequence& seq);
  // Completes step_report_ with the cache's figures and hands it to the observer.
  void ReportStep();

  std::unique_ptr<backend::ForwardBackend> backend_;
  const text::Tokenizer* tokenizer_;
  EngineOptions options_;
  kv::BlockAllocator allocator_;
  std::deque<std::unique_ptr<Sequence>> waiting_;  // arrival order (preempted go to the front)
  std::vector<std::unique_ptr<Sequence>> running_;  // arrival order
  // Imported with an all-position adapter whose copy has not landed: they join running_ once
  // it has (their decode rows need it; the running batch does not wait for it).
  std::vector<std::unique_ptr<Sequence>> importing_;
  std::map<std::string, std::vector<int32_t>> prefilled_;  // blocks held for ReleasePrefilled
  std::map<std::string, GenerationResult> finished_;  // collected for Generate
  bool collect_results_ = false;
  uint64_t next_seed_;
  EngineStats stats_;
  EngineObserver* observer_ = nullptr;
  StepReport step_report_;  // filled during Step
  int64_t evictions_reported_ = 0;
  absl::Time now_;          // when the tokens being appended were sampled
  base::AlignedVector<float> logits_;
  std::vector<std::pair<float, int32_t>> sample_scratch_;
  std::vector<backend::RowSampling> row_sampling_;  // rows sampled by the backend
  std::vector<int32_t> device_tokens_;
};

}  // namespace preft::engine

#include "common/engine/engine.h"

#include <algorithm>
#include <random>
#include <set>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/backend/cpu_backend.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/engine/prefix_cache.h"
#include "common/engine/sampler.h"
#include "common/kernels/cpu/threads.h"
#include "common/kv/blocks.h"

namespace preft::engine {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

struct Engine::Sequence {
  Request request;
  std::vector<int32_t> tokens;  // prompt + generated; all end up in the cache
  int64_t num_prompt = 0;
  int64_t num_computed = 0;
  int64_t max_new = 0;  // max_tokens clipped to the model's context
  std::vector<int32_t> blocks;
  uint64_t seed = 0;
  std::vector<TokenLogprob> logprobs;
  std::unique_ptr<text::StreamDecoder> decoder;
  std::string text;     // emitted text
  std::string pending;  // decoded but held back: may be the start of a stop string
  model::AdapterPositions adapter_positions = model::AdapterPositions::kAll;
  std::vector<uint8_t> mask;  // per-step scratch: adapter mask of the tokens computed now
  bool imported = false;      // prompt KV computed elsewhere: never recomputed here
  // Prefix caching: content addresses of the first full blocks of `tokens`, how many of the
  // blocks held now have theirs published, and the cached run found while waiting.
  std::vector<kv::BlockHash> block_hashes;
  int64_t published = 0;
  int64_t cached_blocks = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the cache at first admission
  bool adapter_ready = false;  // the backend said so once (it stays ready while in use)
  // For the observer (RequestReport).
  absl::Time arrival;
  absl::Time scheduled = absl::InfinitePast();
  absl::Time first_token = absl::InfinitePast();
  absl::Time last_token = absl::InfinitePast();
  int64_t sampled = 0;         // tokens sampled here
  int64_t prompt_counted = 0;  // prompt tokens counted in the stats (not again if recomputed)

  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - num_prompt; }
  AdapterRun adapter_run() const {
    return {request.adapter.weights.get(), adapter_positions, num_prompt};
  }
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(model::Model* model,
                                                       const text::Tokenizer* tokenizer,
                                                       const EngineOptions& options) {
  kernels::cpu::InitThreads(options.num_threads);
  int64_t blocks = options.kv_blocks;
  if (blocks <= 0) {
    const int64_t per_block = model->CacheShape(1, options.scheduler.block_tokens, options.kv_dtype)
                                  .bytes_per_block_all_layers();
    blocks = options.kv_bytes / per_block;
  }
  if (blocks <= 0) return absl::InvalidArgumentError("KV cache budget holds no block");
  PREFT_ASSIGN_OR_RETURN(auto backend,
                         backend::CpuBackend::Create(model, blocks, options.scheduler.block_tokens,
                                                     options.kv_dtype));
  return Create(std::move(backend), tokenizer, options);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    std::unique_ptr<backend::ForwardBackend> backend, const text::Tokenizer* tokenizer,
    const EngineOptions& options) {
  if (backend->cache_shape().dtype != options.kv_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the backend's KV cache stores ", std::string(kv::KvDtypeName(backend->cache_shape().dtype)),
        "; the engine options ask for ", std::string(kv::KvDtypeName(options.kv_dtype))));
  }
  if (backend->cache_shape().block_tokens != options.scheduler.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the backend's KV blocks hold ", backend->cache_shape().block_tokens,
        " tokens; the scheduler expects ", options.scheduler.block_tokens));
  }
  return std::unique_ptr<Engine>(new Engine(std::move(backend), tokenizer, options));
}

namespace {

// How many freed blocks the prefix cache may keep: none when it is off, else every block unless
// capped by --prefix-cache-blocks.
int32_t MaxCachedBlocks(const EngineOptions& options, int64_t num_blocks) {
  if (!options.prefix_caching) return 0;
  const int64_t cap = options.max_cached_blocks > 0 ? options.max_cached_blocks : num_blocks;
  return static_cast<int32_t>(std::min(cap, num_blocks));
}

}  // namespace

Engine::Engine(std::unique_ptr<backend::ForwardBackend> backend, const text::Tokenizer* tokenizer,
               const EngineOptions& options)
    : backend_(std::move(backend)),
      tokenizer_(tokenizer),
      options_(options),
      allocator_(static_cast<int32_t>(backend_->cache_shape().num_blocks),
                 MaxCachedBlocks(options, backend_->cache_shape().num_blocks)),
      next_seed_(std::random_device{}()) {}

Engine::~Engine() = default;

absl::Status Engine::Add(Request request) {
  const model::ModelConfig& c = backend_->config();
  PREFT_RETURN_IF_ERROR(request.sampling.Validate(c.vocab_size));
  PREFT_RETURN_IF_ERROR(ValidatePrompt(request.prompt_ids, c));
  const int64_t n = static_cast<int64_t>(request.prompt_ids.size());
  auto same_id = [&](const std::unique_ptr<Sequence>& s) { return s->request.id == request.id; };
  if (std::any_of(running_.begin(), running_.end(), same_id) ||
      std::any_of(waiting_.begin(), waiting_.end(), same_id) ||
      std::any_of(importing_.begin(), importing_.end(), same_id)) {
    return absl::AlreadyExistsError(absl::StrCat("request id '", request.id, "' is in use"));
  }
  if (prefilled_.count(request.id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request id '", request.id, "' still holds prefilled blocks"));
  }
  if (request.imported && request.on_prefilled) {
    return absl::InvalidArgumentError("a request cannot be both prefill-only and imported");
  }
  auto seq = std::make_unique<Sequence>();
  seq->arrival = absl::Now();
  seq->tokens = request.prompt_ids;
  seq->num_prompt = n;
  seq->max_new = std::min<int64_t>(request.sampling.max_tokens, c.max_position_embeddings - n);
  seq->seed = request.sampling.seed ? *request.sampling.seed : next_seed_++;
  if (tokenizer_ != nullptr) {
    seq->decoder = std::make_unique<text::StreamDecoder>(tokenizer_, /*skip_special_tokens=*/true);
  }
  if (const model::AdapterWeights* a = request.adapter.weights.get()) {
    seq->adapter_positions = request.adapter.positions.value_or(a->default_positions);
    backend_->PrepareAdapter(request.adapter.weights);
  }
  seq->request = std::move(request);
  if (seq->request.imported) return AddImported(std::move(seq));
  waiting_.push_back(std::move(seq));
  return absl::OkStatus();
}

absl::Status Engine::AddImported(std::unique_ptr<Sequence> seq) {
  const ImportedPrompt& in = *seq->request.imported;
  const int64_t bt = options_.scheduler.block_tokens;
  const int64_t need = (seq->num_prompt + bt) / bt;  // the prompt and the first token
  if (static_cast<int64_t>(in.blocks.size()) < need) {
    return absl::InvalidArgumentError(absl::StrCat("imported prompt of ", seq->num_prompt,
                                                   " tokens needs ", need, " blocks, got ",
                                                   in.blocks.size()));
  }
  std::set<int32_t> seen;
  for (int32_t b : in.blocks) {
    if (b < 0 || b >= allocator_.num_blocks() || !allocator_.IsAllocated(b) ||
        !seen.insert(b).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("imported block ", b, " is not a distinct reserved block"));
    }
  }
  const int64_t vocab = backend_->config().vocab_size;
  if (in.first_token < 0 || in.first_token >= vocab) {
    return absl::InvalidArgumentError(absl::StrCat("first token id ", in.first_token,
                                                   " is outside the vocabulary [0, ", vocab, ")"));
  }
  if (seq->request.sampling.logprobs && !in.first_logprob) {
    return absl::InvalidArgumentError(
        "imported prompt has no first-token logprob but the request asks for logprobs");
  }
  // The transport wrote the host cache: a device cache takes from there the blocks that hold
  // the prompt (the rest of the reservation waits for generated tokens).
  const int64_t filled = kv::BlocksFor(seq->num_prompt, bt);
  PREFT_RETURN_IF_ERROR(
      backend_->KvFromHost(std::vector<int32_t>(in.blocks.begin(), in.blocks.begin() + filled)));
  seq->blocks = in.blocks;
  seq->num_computed = seq->num_prompt;
  seq->prompt_counted = seq->num_prompt;  // computed by the prefill worker
  seq->imported = true;
  const int32_t first = in.first_token;
  const std::optional<TokenLogprob> first_logprob = in.first_logprob;
  now_ = absl::Now();
  const FinishReason finish = AppendToken(*seq, first, /*logits=*/nullptr, first_logprob);
  if (finish != FinishReason::kNone) {
    Finish(seq, finish, absl::OkStatus());
  } else if (seq->adapter_positions == model::AdapterPositions::kAll &&
             seq->request.adapter.weights != nullptr) {
    importing_.push_back(std::move(seq));  // Step moves it on once the adapter is there
  } else {
    running_.push_back(std::move(seq));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::AdapterReadyFor(Sequence& seq) {
  if (!seq.adapter_ready) {
    const auto& weights = seq.request.adapter.weights;
    if (weights == nullptr) {
      seq.adapter_ready = true;
    } else {
      PREFT_ASSIGN_OR_RETURN(seq.adapter_ready, backend_->AdapterReady(weights));
    }
  }
  return seq.adapter_ready;
}

void Engine::FailAll(const absl::Status& status) {
  for (auto& s : running_) Finish(s, FinishReason::kError, status);
  for (auto& s : waiting_) Finish(s, FinishReason::kError, status);
  for (auto& s : importing_) Finish(s, FinishReason::kError, status);
  running_.clear();
  waiting_.clear();
  importing_.clear();
}

absl::StatusOr<std::vector<int32_t>> Engine::ReserveBlocks(int64_t n) {
  if (n <= 0 || n > allocator_.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reserve ", n, " blocks of a cache of ",
                                                   allocator_.num_blocks()));
  }
  std::vector<int32_t> blocks;
  PREFT_RETURN_IF_ERROR(allocator_.Allocate(static_cast<int32_t>(n), &blocks));
  return blocks;
}

void Engine::FreeBlocks(const std::vector<int32_t>& blocks) { allocator_.Free(blocks); }

absl::Status Engine::ReleasePrefilled(const std::string& request_id) {
  auto it = prefilled_.find(request_id);
  if (it == prefilled_.end()) {
    return absl::NotFoundError(absl::StrCat("no prefilled blocks held for '", request_id, "'"));
  }
  allocator_.Free(it->second);
  prefilled_.erase(it);
  return absl::OkStatus();
}

void Engine::HandOverPrefilled(std::unique_ptr<Sequence>& seq, int32_t token,
                               const float* logits) {
  // The transport reads the host cache: a device cache's blocks are copied there first.
  if (absl::Status s = backend_->KvToHost(seq->blocks); !s.ok()) {
    Finish(seq, FinishReason::kError, s);
    return;
  }
  const SamplingParams& sp = seq->request.sampling;
  PrefilledPrompt p;
  p.request_id = seq->request.id;
  p.first_token = token;
  if (sp.logprobs) {
    p.first_logprob =
        LogprobsFor(logits, backend_->config().vocab_size, sp, token, &sample_scratch_);
  }
  p.num_tokens = seq->num_prompt;
  p.seed = seq->seed;
  p.cached_tokens = seq->cached_tokens;
  p.blocks = std::move(seq->blocks);
  seq->blocks.clear();
  prefilled_[p.request_id] = p.blocks;
  ++stats_.generated_tokens;
  seq->first_token = now_;
  seq->request.on_prefilled(p);
  seq->tokens.push_back(token);  // the result (Generate) shows the first token
  Finish(seq, FinishReason::kLength, absl::OkStatus());
}

absl::Status Engine::Abort(const std::string& request_id) {
  auto abort_in = [&](auto& queue) {
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if ((*it)->request.id == request_id) {
        Finish(*it, FinishReason::kAbort, absl::CancelledError("aborted"));
        queue.erase(it);
        return true;
      }
    }
    return false;
  };
  if (abort_in(running_) || abort_in(waiting_) || abort_in(importing_)) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("no active request '", request_id, "'"));
}

void Engine::Finish(std::unique_ptr<Sequence>& seq, FinishReason reason, absl::Status status) {
  allocator_.Free(seq->blocks);
  seq->blocks.clear();
  if (observer_ != nullptr) {
    RequestReport r;
    r.finish = reason;
    r.prefill_only = static_cast<bool>(seq->request.on_prefilled);
    r.imported = seq->imported;
    r.prompt_tokens = seq->num_prompt;
    r.cached_prompt_tokens = seq->cached_tokens;
    r.generated_tokens = seq->sampled;
    r.arrival = seq->arrival;
    r.scheduled = seq->scheduled;
    r.first_token = seq->first_token;
    r.end = absl::Now();
    observer_->OnRequestEnd(r);
  }
  if (seq->request.on_token && (reason == FinishReason::kAbort || reason == FinishReason::kError)) {
    TokenEvent e;
    e.request_id = seq->request.id;
    e.finish = reason;
    e.status = status;
    seq->request.on_token(e);
  }
  if (collect_results_) {
    GenerationResult r;
    r.request_id = seq->request.id;
    r.prompt_ids.assign(seq->tokens.begin(), seq->tokens.begin() + seq->num_prompt);
    r.token_ids.assign(seq->tokens.begin() + seq->num_prompt, seq->tokens.end());
    r.text = seq->text;
    r.finish = reason;
    r.status = status;
    r.logprobs = std::move(seq->logprobs);
    r.cached_prompt_tokens = seq->cached_tokens;
    if (seq->request.adapter.weights) {
      r.adapter = seq->request.adapter.name;
      r.adapter_version = seq->request.adapter.version;
      r.adapter_positions = seq->adapter_positions;
    }
    finished_[r.request_id] = std::move(r);
  }
  seq.reset();
}

void Engine::Preempt(Sequence& seq) {
  allocator_.Free(seq.blocks);
  seq.blocks.clear();
  seq.published = 0;
  seq.num_computed = 0;  // recompute prompt + generated tokens when readmitted
  ++stats_.preemptions;
  ++step_report_.preemptions;
}

bool Engine::UsesPrefixCache(const Sequence& seq) const {
  // Imported prompts were computed elsewhere (the decode tier): they neither look up nor publish.
  return allocator_.max_cached() > 0 && !seq.imported;
}

int64_t Engine::CachedPrefixBlocks(Sequence& seq) {
  if (!UsesPrefixCache(seq)) return 0;
  const int64_t bt = options_.scheduler.block_tokens;
  const int64_t most = (static_cast<int64_t>(seq.tokens.size()) - 1) / bt;
  ExtendBlockHashes(seq.tokens, most, bt, seq.adapter_run(), &seq.block_hashes);
  int64_t n = 0;
  while (n < most && allocator_.Peek(seq.block_hashes[n]) >= 0) ++n;
  return n;
}

void Engine::TakeCachedPrefix(Sequence& seq) {
  if (!UsesPrefixCache(seq)) return;
  const int64_t bt = options_.scheduler.block_tokens;
  for (int64_t b = 0; b < seq.cached_blocks; ++b) {
    const int32_t block = allocator_.Acquire(seq.block_hashes[b]);
    PREFT_CHECK(block >= 0);  // found while scheduling; nothing was evicted since
    seq.blocks.push_back(block);
  }
  seq.published = seq.cached_blocks;
  seq.num_computed = seq.cached_blocks * bt;
  if (seq.scheduled == absl::InfinitePast()) seq.cached_tokens = seq.num_computed;
  const int64_t queried = static_cast<int64_t>(seq.tokens.size());
  stats_.prefix_query_tokens += queried;
  stats_.prefix_hit_tokens += seq.num_computed;
  step_report_.prefix_query_tokens += queried;
  step_report_.prefix_hit_tokens += seq.num_computed;
}

void Engine::PublishFullBlocks(Sequence& seq) {
  if (!UsesPrefixCache(seq)) return;
  const int64_t bt = options_.scheduler.block_tokens;
  const int64_t full = std::min(seq.num_computed / bt, static_cast<int64_t>(seq.blocks.size()));
  if (seq.published >= full) return;
  ExtendBlockHashes(seq.tokens, full, bt, seq.adapter_run(), &seq.block_hashes);
  for (; seq.published < full; ++seq.published) {
    allocator_.Publish(seq.blocks[seq.published], seq.block_hashes[seq.published]);
  }
}

namespace {

// Moves the text of `pending` that is safe to emit into the result. With stop strings, text
// that might be the start of one is held back; on a match everything from the match on stays
// in `pending` (the caller drops it) and the text before it is returned. `final` releases
// whatever is held.
std::string TakeText(const std::vector<std::string>& stops, bool final, std::string* pending) {
  size_t match = std::string::npos;
  for (const std::string& s : stops) match = std::min(match, pending->find(s));
  if (match != std::string::npos) {
    std::string out = pending->substr(0, match);
    pending->erase(0, match);
    return out;
  }
  size_t hold = 0;
  if (!final) {
    for (const std::string& s : stops) {
      for (size_t k = std::min(s.size() - 1, pending->size()); k > hold; --k) {
        if (pending->compare(pending->size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
  }
  std::string out = pending->substr(0, pending->size() - hold);
  pending->erase(0, pending->size() - hold);
  return out;
}

}  // namespace

FinishReason Engine::AppendToken(Sequence& seq, int32_t token, const float* logits,
                                 const std::optional<TokenLogprob>& logprob) {
  const SamplingParams& sp = seq.request.sampling;
  const model::ModelConfig& c = backend_->config();
  seq.tokens.push_back(token);
  ++stats_.generated_tokens;
  if (seq.first_token == absl::InfinitePast()) {
    seq.first_token = now_;
  } else {
    step_report_.inter_token.push_back(now_ - seq.last_token);
  }
  seq.last_token = now_;
  const TokenLogprob* lp = nullptr;
  if (sp.logprobs) {
    seq.logprobs.push_back(logprob ? *logprob
                                   : LogprobsFor(logits, c.vocab_size, sp, token, &sample_scratch_));
    lp = &seq.logprobs.back();
  }
  FinishReason finish = FinishReason::kNone;
  const bool is_eos =
      std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), token) != c.eos_token_ids.end();
  if ((is_eos && !sp.ignore_eos) || std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(),
                                              token) != sp.stop_token_ids.end()) {
    finish = FinishReason::kStop;
  }
  if (finish == FinishReason::kNone && seq.num_generated() >= seq.max_new) {
    finish = FinishReason::kLength;
  }
  std::string delta;
  if (seq.decoder) {
    if (finish != FinishReason::kStop) seq.pending += seq.decoder->Push(token);
    if (finish != FinishReason::kNone) seq.pending += seq.decoder->Flush();
    delta = TakeText(sp.stop, finish != FinishReason::kNone, &seq.pending);
    if (!seq.pending.empty()) {  // a stop string matched: the rest is dropped
      seq.pending.clear();
      finish = FinishReason::kStop;
    }
    seq.text += delta;
  }
  if (seq.request.on_token) {
    TokenEvent e;
    e.request_id = seq.request.id;
    e.token_id = token;
    e.text_delta = std::move(delta);
    e.logprob = lp;
    e.finish = finish;
    e.cached_prompt_tokens = seq.cached_tokens;
    seq.request.on_token(e);
  }
  return finish;
}

absl::Status Engine::Step() {
  const absl::Time start = absl::Now();
  step_report_.num_sequences = step_report_.num_tokens = step_report_.prompt_tokens = 0;
  step_report_.generated_tokens = step_report_.preemptions = 0;
  step_report_.prefix_query_tokens = step_report_.prefix_hit_tokens = 0;
  step_report_.inter_token.clear();
  // A sequence whose adapter the backend could not prepare fails alone, before scheduling;
  // imported ones whose adapter has landed start decoding.
  bool adapters_in_flight = false;
  auto check_adapters = [&](auto& queue, bool move_ready_to_running) {
    for (auto it = queue.begin(); it != queue.end();) {
      absl::StatusOr<bool> ready = AdapterReadyFor(**it);
      if (!ready.ok()) {
        Finish(*it, FinishReason::kError, ready.status());
        it = queue.erase(it);
      } else if (*ready && move_ready_to_running) {
        running_.push_back(std::move(*it));
        it = queue.erase(it);
      } else {
        adapters_in_flight = adapters_in_flight || !*ready;
        ++it;
      }
    }
  };
  check_adapters(importing_, /*move_ready_to_running=*/true);
  check_adapters(waiting_, /*move_ready_to_running=*/false);
  std::vector<SequenceView> running_views, waiting_views;
  for (const auto& s : running_) {
    running_views.push_back({static_cast<int64_t>(s->tokens.size()), s->num_computed,
                             static_cast<int64_t>(s->blocks.size())});
  }
  const int64_t bt = options_.scheduler.block_tokens;
  for (const auto& s : waiting_) {
    // A waiting sequence holds no block. Its cached prefix counts as computed, and its blocks
    // as blocks to allocate: admission needs as many free blocks as without the cache (so the
    // cache never admits what could not run), while the token budget pays only for the rest.
    s->cached_blocks = CachedPrefixBlocks(*s);
    waiting_views.push_back({static_cast<int64_t>(s->tokens.size()), s->cached_blocks * bt,
                             static_cast<int64_t>(s->blocks.size()), s->adapter_ready});
  }
  const ScheduleDecision d = Schedule(options_.scheduler, running_views, waiting_views,
                                      allocator_.num_free(), allocator_.num_blocks());

  // Resolve the decision's indices to sequences before any queue changes.
  std::vector<std::pair<Sequence*, int64_t>> work;  // (sequence, tokens to compute)
  std::vector<int64_t> new_blocks;
  for (const ScheduleItem& item : d.items) {
    Sequence* s = item.running ? running_[item.index].get() : waiting_[item.index].get();
    work.emplace_back(s, item.num_new);
    new_blocks.push_back(item.new_blocks);
  }
  std::unordered_set<Sequence*> preempted, admitted, rejected;
  for (int64_t i : d.preempted) preempted.insert(running_[i].get());
  for (const ScheduleItem& item : d.items)
    if (!item.running) admitted.insert(waiting_[item.index].get());
  for (int64_t i : d.rejected) rejected.insert(waiting_[i].get());

  // Preempted sequences go back to the front of the queue, oldest first.
  std::vector<std::unique_ptr<Sequence>> still_running;
  std::vector<std::unique_ptr<Sequence>> back_to_waiting;
  for (auto& s : running_) {
    if (preempted.count(s.get()) && s->imported) {
      Finish(s, FinishReason::kError,
             absl::ResourceExhaustedError("out of KV blocks: an imported prompt cannot be "
                                          "recomputed here (reserve its blocks up front)"));
    } else if (preempted.count(s.get())) {
      Preempt(*s);
      back_to_waiting.push_back(std::move(s));
    } else {
      still_running.push_back(std::move(s));
    }
  }
  std::deque<std::unique_ptr<Sequence>> still_waiting;
  for (auto& s : waiting_) {
    if (admitted.count(s.get())) {
      TakeCachedPrefix(*s);  // before any allocation, which could evict what it found
      if (s->scheduled == absl::InfinitePast()) s->scheduled = start;
      still_running.push_back(std::move(s));
    } else if (rejected.count(s.get())) {
      Finish(s, FinishReason::kError,
             absl::ResourceExhaustedError(
                 absl::StrCat("prompt of ", s->num_prompt, " tokens needs ",
                              (static_cast<int64_t>(s->tokens.size()) + bt) / bt,
                              " KV blocks; the cache has ", allocator_.num_blocks())));
    } else {
      still_waiting.push_back(std::move(s));
    }
  }
  for (auto it = back_to_waiting.rbegin(); it != back_to_waiting.rend(); ++it)
    still_waiting.push_front(std::move(*it));
  running_ = std::move(still_running);
  waiting_ = std::move(still_waiting);
  if (work.empty()) {
    if (observer_ != nullptr && step_report_.preemptions > 0) ReportStep();
    // Only sequences whose adapters are still being copied: let the copies run instead of
    // asking again at once (the loop calls Step while there is work).
    if (adapters_in_flight) absl::SleepFor(absl::Microseconds(200));
    return absl::OkStatus();
  }

  model::ForwardBatch batch;
  std::vector<Sequence*> sampled;
  for (size_t i = 0; i < work.size(); ++i) {
    Sequence* s = work[i].first;
    const int64_t n = work[i].second;
    // The decision counted a cached prefix's blocks as new; those are held already. (An
    // imported sequence holds its whole reservation: nothing more.)
    const int64_t more = std::max<int64_t>(
        0, kv::BlocksFor(s->num_computed + n, bt) - static_cast<int64_t>(s->blocks.size()));
    PREFT_CHECK(more <= new_blocks[i]);
    PREFT_CHECK(allocator_.Allocate(static_cast<int32_t>(more), &s->blocks).ok());
    const int64_t context = s->num_computed + n;
    const bool last_chunk = context == static_cast<int64_t>(s->tokens.size());
    const model::AdapterWeights* adapter = s->request.adapter.weights.get();
    if (adapter != nullptr) {
      // Prompt tokens (the ones the adapter's selection picks) always; generated tokens only
      // when the adapter runs on all positions. Recomputed tokens after a preemption get the
      // same mask they had the first time.
      s->mask.resize(n);
      bool any = false;
      const AdapterRun run = s->adapter_run();
      for (int64_t i = 0; i < n; ++i) {
        s->mask[i] = run.RunsAt(s->num_computed + i);
        any = any || s->mask[i];
      }
      // Rows the adapter touches none of (a PreFT sequence's generated tokens) run as base
      // rows: the backend then neither holds nor lays out the adapter for this step.
      if (!any) adapter = nullptr;
    }
    batch.AddSequence(s->blocks.data(), static_cast<int64_t>(s->blocks.size()),
                      s->tokens.data() + s->num_computed, n, context, last_chunk, adapter,
                      adapter != nullptr ? s->mask.data() : nullptr);
    // Prompt tokens recomputed after a preemption are not counted again.
    const int64_t prompt = std::min(context, s->num_prompt) - s->prompt_counted;
    if (prompt > 0) {
      s->prompt_counted += prompt;
      stats_.prompt_tokens += prompt;
      step_report_.prompt_tokens += prompt;
    }
    step_report_.num_tokens += n;
    if (last_chunk) sampled.push_back(s);
  }
  step_report_.num_sequences = static_cast<int64_t>(work.size());
  // A backend that samples where its logits are (a GPU) returns only the tokens, unless a
  // row's request wants logprobs, which are computed here from the logits.
  bool on_device = backend_->samples_on_device() && !sampled.empty();
  for (const Sequence* s : sampled) on_device = on_device && !s->request.sampling.logprobs;
  if (on_device) {
    row_sampling_.clear();
    for (const Sequence* s : sampled) {
      const SamplingParams& sp = s->request.sampling;
      row_sampling_.push_back({sp.temperature, sp.top_p, sp.min_p, sp.top_k, s->seed,
                               static_cast<uint64_t>(s->num_generated())});
    }
    PREFT_RETURN_IF_ERROR(backend_->ForwardSample(batch, row_sampling_, &device_tokens_));
  } else {
    PREFT_RETURN_IF_ERROR(backend_->Forward(batch, &logits_));
  }
  now_ = absl::Now();
  step_report_.forward = now_ - start;
  step_report_.generated_tokens = static_cast<int64_t>(sampled.size());
  ++stats_.steps;
  for (auto& [s, n] : work) {
    s->num_computed += n;
    PublishFullBlocks(*s);
  }

  const int64_t vocab = backend_->config().vocab_size;
  std::map<Sequence*, FinishReason> done;
  std::map<Sequence*, int32_t> prefill_done;  // prefill-only: hand over instead of decoding
  std::map<Sequence*, const float*> rows;
  for (size_t r = 0; r < sampled.size(); ++r) {
    Sequence* s = sampled[r];
    // Without logits (sampled on the device) no row asked for logprobs, the rows' only use.
    const float* row = on_device ? nullptr : logits_.data() + r * vocab;
    rows[s] = row;
    const int32_t token =
        on_device ? device_tokens_[r]
                  : SampleToken(row, vocab, s->request.sampling, s->seed,
                                static_cast<uint64_t>(s->num_generated()), &sample_scratch_);
    ++s->sampled;
    if (s->request.on_prefilled) {
      prefill_done[s] = token;
      continue;
    }
    const FinishReason finish = AppendToken(*s, token, row);
    if (finish != FinishReason::kNone) done[s] = finish;
  }
  if (!done.empty() || !prefill_done.empty()) {
    std::vector<std::unique_ptr<Sequence>> keep;
    for (auto& s : running_) {
      auto it = done.find(s.get());
      auto pit = prefill_done.find(s.get());
      if (pit != prefill_done.end()) {
        HandOverPrefilled(s, pit->second, rows[s.get()]);
      } else if (it != done.end()) {
        Finish(s, it->second, absl::OkStatus());
      } else {
        keep.push_back(std::move(s));
      }
    }
    running_ = std::move(keep);
  }
  if (observer_ != nullptr) ReportStep();
  return absl::OkStatus();
}

void Engine::ReportStep() {
  step_report_.prefix_evictions = allocator_.evictions() - evictions_reported_;
  evictions_reported_ = allocator_.evictions();
  step_report_.cached_blocks = allocator_.num_cached();
  observer_->OnStep(step_report_);
}

absl::StatusOr<std::vector<GenerationResult>> Engine::Generate(std::vector<Request> requests) {
  collect_results_ = true;
  std::vector<std::string> ids;
  for (Request& r : requests) {
    ids.push_back(r.id);
    PREFT_RETURN_IF_ERROR(Add(std::move(r)));
  }
  while (HasWork()) PREFT_RETURN_IF_ERROR(Step());
  std::vector<GenerationResult> out;
  for (const std::string& id : ids) {
    auto it = finished_.find(id);
    PREFT_CHECK(it != finished_.end());
    out.push_back(std::move(it->second));
    finished_.erase(it);
  }
  collect_results_ = false;
  return out;
}

}  // namespace preft::engine

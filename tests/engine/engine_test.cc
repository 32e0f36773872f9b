#include "common/engine/engine.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/backend/cpu_backend.h"
#include "common/engine/sampler.h"
#include "tests/engine/tiny_engine_fixture.h"

namespace preft::engine {
namespace {

class EngineTest : public TinyEngineTest {
 protected:
  static Request MakeRequest(const std::string& id, int n_prompt, int max_tokens, float temp,
                             uint64_t seed) {
    Request r;
    r.id = id;
    for (int i = 0; i < n_prompt; ++i) r.prompt_ids.push_back((i * 37 + seed * 11) % 298);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temp;
    r.sampling.top_p = temp > 0 ? 0.9f : 1.f;
    r.sampling.seed = seed;
    r.sampling.ignore_eos = true;
    return r;
  }

  static GenerationResult RunAloneResult(const Request& r,
                                         kv::KvDtype kv_dtype = kv::KvDtype::kF32) {
    auto e = MakeEngine(256, 512, kv_dtype);
    auto out = e->Generate({r});
    EXPECT_TRUE(out.ok()) << out.status();
    return out->front();
  }
  static std::vector<int32_t> RunAlone(const Request& r, kv::KvDtype kv_dtype = kv::KvDtype::kF32) {
    return RunAloneResult(r, kv_dtype).token_ids;
  }

};

// A request's tokens do not depend on its batch: alone vs among 15 others, with chunked
// prefill (small token budget) mixing prompt chunks and decode rows, greedy and seeded.
// The engine over an explicit backend: the CPU backend gives the same tokens as the model
// path, and a backend whose blocks do not match the scheduler's is refused.
TEST_F(EngineTest, RunsOverAnExplicitBackendAndChecksItsBlockSize) {
  const Request r = MakeRequest("b", 21, 8, 0.f, 4);
  auto backend = backend::CpuBackend::Create(model_, 64, 16);
  ASSERT_TRUE(backend.ok());
  EXPECT_STREQ((*backend)->name(), "cpu");
  auto e = Engine::Create(*std::move(backend), tokenizer_, EngineOptions{});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NE((*e)->cache(), nullptr);
  auto out = (*e)->Generate({r});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->front().token_ids, RunAlone(r));

  auto odd = backend::CpuBackend::Create(model_, 64, 32);
  ASSERT_TRUE(odd.ok());
  auto refused = Engine::Create(*std::move(odd), tokenizer_, EngineOptions{});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("32 tokens"), std::string::npos) << refused.status();
}

// A CPU backend that says it samples where its logits are: ForwardSample runs the forward
// and samples each row with the RowSampling the engine passed. The engine's path for such a
// backend (a GPU's, where SampleRows samples on the device) is checked here against its host
// path: the same tokens, and Forward (logits) only for steps where a row wants logprobs.
class RowSamplingCpuBackend : public backend::ForwardBackend {
 public:
  explicit RowSamplingCpuBackend(std::unique_ptr<backend::CpuBackend> cpu) : cpu_(std::move(cpu)) {}
  const model::ModelConfig& config() const override { return cpu_->config(); }
  const kv::KvCacheShape& cache_shape() const override { return cpu_->cache_shape(); }
  absl::Status Forward(const model::ForwardBatch& batch,
                       base::AlignedVector<float>* logits) override {
    ++forward_calls;
    return cpu_->Forward(batch, logits);
  }
  bool samples_on_device() const override { return true; }
  absl::Status ForwardSample(const model::ForwardBatch& batch,
                             const std::vector<backend::RowSampling>& rows,
                             std::vector<int32_t>* tokens) override {
    ++sample_calls;
    if (rows.size() != batch.logit_rows.size()) return absl::InternalError("rows != logit rows");
    absl::Status s = cpu_->Forward(batch, &logits_);
    if (!s.ok()) return s;
    const int64_t vocab = config().vocab_size;
    tokens->resize(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      SamplingParams p;
      p.temperature = rows[r].temperature;
      p.top_p = rows[r].top_p;
      p.min_p = rows[r].min_p;
      p.top_k = rows[r].top_k;
      (*tokens)[r] = SampleToken(logits_.data() + r * vocab, vocab, p, rows[r].seed,
                                 rows[r].step, &scratch_);
    }
    return absl::OkStatus();
  }
  kernels::DType adapter_dtype() const override { return cpu_->adapter_dtype(); }
  kv::KvCache* host_cache() override { return cpu_->host_cache(); }
  const char* name() const override { return "cpu-row-sampling"; }

  int forward_calls = 0;
  int sample_calls = 0;

 private:
  std::unique_ptr<backend::CpuBackend> cpu_;
  base::AlignedVector<float> logits_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

TEST_F(EngineTest, BackendSamplingGivesTheHostSamplersTokens) {
  std::vector<Request> batch;
  for (int i = 0; i < 6; ++i) {
    Request r = MakeRequest("r" + std::to_string(i), 9 + 5 * i, 12, i % 3 == 0 ? 0.f : 0.9f, 30 + i);
    r.sampling.top_k = i == 2 ? 7 : 0;
    r.sampling.min_p = i == 4 ? 0.05f : 0.f;
    batch.push_back(std::move(r));
  }
  for (const bool logprobs : {false, true}) {
    SCOPED_TRACE(logprobs ? "one request wants logprobs" : "no logprobs");
    std::vector<Request> reqs = batch;
    if (logprobs) reqs[1].sampling.logprobs = 2;
    auto cpu = backend::CpuBackend::Create(model_, 256, 16);
    ASSERT_TRUE(cpu.ok());
    auto owned = std::make_unique<RowSamplingCpuBackend>(*std::move(cpu));
    RowSamplingCpuBackend* backend = owned.get();
    EngineOptions o;
    o.scheduler.max_batch_tokens = 40;  // prompt chunks beside decode rows
    auto device = Engine::Create(std::move(owned), tokenizer_, o);
    ASSERT_TRUE(device.ok()) << device.status();
    auto host = MakeEngine(256, 40);
    auto want = host->Generate(reqs);
    auto got = (*device)->Generate(reqs);
    ASSERT_TRUE(want.ok() && got.ok());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ((*got)[i].token_ids, (*want)[i].token_ids) << "request " << i;
      EXPECT_EQ((*got)[i].logprobs.size(), (*want)[i].logprobs.size()) << "request " << i;
    }
    // Logits cross only for steps that sample nothing (prompt chunks) or, with logprobs,
    // while request 1 generates its 12 tokens.
    EXPECT_GE(backend->sample_calls, logprobs ? 1 : 12);
    if (logprobs) {
      EXPECT_GE(backend->forward_calls, 12);
    }
  }
}

// Largest |logprob(bf16 KV) - logprob(f32 KV)| over a greedy generation on the tiny model.
// Measured 1.05e-2 (24 tokens after a 40-token prompt): bf16 keeps 8 significant bits of each
// K and V element (relative error <= 2^-9), and the error compounds through the layers.
constexpr double kBf16KvLogprobTolerance = 3e-2;
// The same for fp8 e4m3 KV (4 significant bits, relative error <= 2^-4, scales 1), over the
// steps before the first token that differs: measured 0.22.
constexpr double kFp8KvLogprobTolerance = 0.5;

// The KV dtypes the CPU engine stores: each must keep batch invariance on its own.
constexpr kv::KvDtype kCpuKvDtypes[] = {kv::KvDtype::kF32, kv::KvDtype::kBF16,
                                        kv::KvDtype::kFp8E4M3};

TEST_F(EngineTest, TokensAreIdenticalAloneAndInABusyBatch) {
  for (const kv::KvDtype kv_dtype : kCpuKvDtypes) {
  SCOPED_TRACE(std::string("KV ") + std::string(kv::KvDtypeName(kv_dtype)));
  Request greedy = MakeRequest("greedy", 45, 20, 0.f, 1);
  Request sampled = MakeRequest("sampled", 23, 20, 0.8f, 2);
  greedy.sampling.logprobs = sampled.sampling.logprobs = 3;
  const GenerationResult greedy_alone = RunAloneResult(greedy, kv_dtype);
  const GenerationResult sampled_alone = RunAloneResult(sampled, kv_dtype);
  ASSERT_EQ(greedy_alone.token_ids.size(), 20u);

  std::vector<Request> batch;
  for (int i = 0; i < 15; ++i)
    batch.push_back(MakeRequest("other" + std::to_string(i), 5 + 7 * i, 10 + i, i % 2 ? 1.f : 0.f, 100 + i));
  batch.insert(batch.begin() + 3, greedy);
  batch.insert(batch.begin() + 9, sampled);
  auto e = MakeEngine(256, /*batch_tokens=*/48, kv_dtype);
  auto out = e->Generate(batch);
  ASSERT_TRUE(out.ok()) << out.status();
  // Bit for bit: tokens and every logprob (the linears sum each row in one order at any m).
  for (const auto& [got, want] : {std::pair{&(*out)[3], &greedy_alone},
                                  std::pair{&(*out)[9], &sampled_alone}}) {
    EXPECT_EQ(got->token_ids, want->token_ids);
    ASSERT_EQ(got->logprobs.size(), want->logprobs.size());
    for (size_t i = 0; i < got->logprobs.size(); ++i) {
      EXPECT_EQ(got->logprobs[i].logprob, want->logprobs[i].logprob) << "step " << i;
      EXPECT_EQ(got->logprobs[i].top, want->logprobs[i].top) << "step " << i;
    }
  }
  EXPECT_GT(e->stats().steps, 20);
  EXPECT_EQ(e->allocator().num_free(), 256);  // everything returned
  }
}

// With a cache too small for everyone, sequences get preempted and recomputed; their tokens
// are still exactly those of a run alone, and no block leaks.
TEST_F(EngineTest, PreemptionRecomputesWithoutChangingTokens) {
  for (const kv::KvDtype kv_dtype : kCpuKvDtypes) {
  SCOPED_TRACE(std::string("KV ") + std::string(kv::KvDtypeName(kv_dtype)));
  std::vector<Request> batch;
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < 6; ++i) {
    batch.push_back(MakeRequest("r" + std::to_string(i), 20 + 3 * i, 30, i % 2 ? 0.7f : 0.f, 7 + i));
    alone.push_back(RunAlone(batch.back(), kv_dtype));
  }
  auto e = MakeEngine(12, 512, kv_dtype);  // 192 token slots for ~6 x 55 tokens
  auto out = e->Generate(batch);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE((*out)[i].status.ok()) << (*out)[i].status;
    EXPECT_EQ((*out)[i].token_ids, alone[i]) << "request " << i;
  }
  EXPECT_GT(e->stats().preemptions, 0);
  EXPECT_EQ(e->allocator().num_free(), 12);
  }
}

// bf16 KV is not f32 KV (each K and V element keeps 8 significant bits), but on this model it
// moves logprobs by little and changes no greedy token. fp8 keeps 4 bits: it moves them more,
// and this model's flat distributions (top logprobs near -1) make a near tie flip a greedy
// token after a few steps (measured: the 7th), so fp8 is compared until the first differing
// token (the oracle test in tests/python checks fp8 exactly, against rounding in the oracle).
// The same cache budget holds twice the blocks at bf16, four times at fp8.
TEST_F(EngineTest, NarrowKvStaysCloseToF32AndHoldsMoreBlocks) {
  Request r = MakeRequest("close", 40, 24, 0.f, 3);
  r.sampling.logprobs = 1;
  const GenerationResult f32 = RunAloneResult(r, kv::KvDtype::kF32);
  struct Expectation {
    kv::KvDtype dtype;
    double tolerance;
    size_t same_tokens;  // at least this many leading tokens equal f32's
  };
  for (const Expectation& x : {Expectation{kv::KvDtype::kBF16, kBf16KvLogprobTolerance, 24},
                               Expectation{kv::KvDtype::kFp8E4M3, kFp8KvLogprobTolerance, 4}}) {
    SCOPED_TRACE(std::string(kv::KvDtypeName(x.dtype)));
    const GenerationResult narrow = RunAloneResult(r, x.dtype);
    ASSERT_EQ(narrow.token_ids.size(), f32.token_ids.size());
    ASSERT_EQ(narrow.logprobs.size(), f32.logprobs.size());
    size_t same = 0;
    while (same < f32.token_ids.size() && narrow.token_ids[same] == f32.token_ids[same]) ++same;
    EXPECT_GE(same, x.same_tokens);
    double worst = 0;  // over the steps whose contexts are the same
    for (size_t i = 0; i < std::min(same + 1, f32.logprobs.size()); ++i) {
      worst = std::max(worst, std::abs(double(narrow.logprobs[i].logprob) - f32.logprobs[i].logprob));
    }
    EXPECT_LT(worst, x.tolerance);
    EXPECT_GT(worst, 0) << "gave f32's logprobs exactly: is the KV stored as f32?";
    std::printf("%s KV: %zu leading tokens as f32 KV's, largest logprob difference %.3g\n",
                std::string(kv::KvDtypeName(x.dtype)).c_str(), same, worst);
  }

  const int64_t f32_block = model_->CacheShape(1, 16).bytes_per_block_all_layers();
  for (const auto& [dtype, blocks] : {std::pair{kv::KvDtype::kF32, 10}, {kv::KvDtype::kBF16, 20},
                                     {kv::KvDtype::kFp8E4M3, 40}}) {
    EngineOptions o;
    o.kv_bytes = 10 * f32_block;
    o.kv_dtype = dtype;
    auto e = Engine::Create(model_, tokenizer_, o);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->cache()->shape().dtype, dtype);
    EXPECT_EQ((*e)->allocator().num_free(), blocks);
    EXPECT_EQ((*e)->cache()->bytes(), static_cast<size_t>(10 * f32_block));
  }
}

TEST_F(EngineTest, PromptThatCannotFitFailsClearlyAndOthersFinish) {
  auto e = MakeEngine(4);  // 64 token slots
  std::vector<Request> batch = {MakeRequest("big", 100, 4, 0.f, 1), MakeRequest("ok", 10, 4, 0.f, 2)};
  auto out = e->Generate(batch);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].finish, FinishReason::kError);
  EXPECT_EQ((*out)[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE((*out)[0].status.message().find("prompt of 100 tokens needs 7 KV blocks; the cache has 4"),
            std::string::npos)
      << (*out)[0].status;
  EXPECT_EQ((*out)[1].token_ids.size(), 4u);
}

TEST_F(EngineTest, BadRequestsAreRejectedAtAdmission) {
  auto e = MakeEngine(16);
  Request empty = MakeRequest("empty", 0, 4, 0.f, 1);
  EXPECT_EQ(e->Add(empty).code(), absl::StatusCode::kInvalidArgument);
  Request oov = MakeRequest("oov", 3, 4, 0.f, 1);
  oov.prompt_ids[1] = 300;
  absl::Status s = e->Add(oov);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token id 300"), std::string::npos) << s;
  Request too_long = MakeRequest("long", 2048, 4, 0.f, 1);
  EXPECT_NE(e->Add(too_long).message().find("context is 2048"), std::string::npos);
  Request bad_p = MakeRequest("badp", 3, 4, 1.f, 1);
  bad_p.sampling.top_p = 1.5f;
  EXPECT_NE(e->Add(bad_p).message().find("top_p"), std::string::npos);
  ASSERT_TRUE(e->Add(MakeRequest("dup", 3, 4, 0.f, 1)).ok());
  EXPECT_EQ(e->Add(MakeRequest("dup", 3, 4, 0.f, 1)).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(EngineTest, AbortFreesBlocksAndReportsAbort) {
  auto e = MakeEngine(32);
  std::vector<TokenEvent> events;
  Request r = MakeRequest("a", 10, 100, 0.f, 1);
  r.on_token = [&](const TokenEvent& ev) { events.push_back(ev); };
  ASSERT_TRUE(e->Add(r).ok());
  ASSERT_TRUE(e->Step().ok());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_LT(e->allocator().num_free(), 32);
  ASSERT_TRUE(e->Abort("a").ok());
  EXPECT_EQ(e->allocator().num_free(), 32);
  EXPECT_FALSE(e->HasWork());
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().finish, FinishReason::kAbort);
  EXPECT_EQ(e->Abort("a").code(), absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, StopStringCutsTheTextAndStops) {
  Request r = MakeRequest("s", 12, 24, 0.f, 3);
  auto e = MakeEngine(64);
  auto full = e->Generate({r});
  ASSERT_TRUE(full.ok());
  const std::string text = full->front().text;
  ASSERT_GE(text.size(), 8u) << text;
  const std::string stop = text.substr(text.size() / 2, 3);
  const std::string expected = text.substr(0, text.find(stop));
  r.sampling.stop = {stop};
  std::string streamed;
  r.on_token = [&](const TokenEvent& ev) { streamed += ev.text_delta; };
  auto cut = e->Generate({r});
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->front().text, expected);
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(cut->front().finish, FinishReason::kStop);
  EXPECT_LT(cut->front().token_ids.size(), full->front().token_ids.size());
}

TEST_F(EngineTest, StopTokenIdEndsGeneration) {
  Request r = MakeRequest("t", 12, 24, 0.f, 3);
  auto e = MakeEngine(64);
  auto full = e->Generate({r});
  ASSERT_TRUE(full.ok());
  const int32_t stop_id = full->front().token_ids[5];
  r.sampling.stop_token_ids = {stop_id};
  auto cut = e->Generate({r});
  ASSERT_TRUE(cut.ok());
  const auto& ids = cut->front().token_ids;
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), stop_id);
  EXPECT_LE(ids.size(), 6u);
  EXPECT_EQ(cut->front().finish, FinishReason::kStop);
}

}  // namespace
}  // namespace preft::engine

// Adapters through the engine: the fixture's six reference modes, LoRA against merged
// weights, LoRAP/DiReFTP against "adapted prefill, then base decode", and batch invariance
// across 32 adapters mixed with base-only requests.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "common/backend/cpu_backend.h"
#include "common/base/mapped_file.h"
#include "common/engine/engine.h"
#include "common/engine/sampler.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/low_rank.h"
#include "common/model/make_model.h"
#include "common/model/model.h"
#include "common/model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/fixtures.h"

namespace preft {
namespace {

namespace fs = std::filesystem;
using engine::Engine;
using engine::GenerationResult;
using engine::Request;
using model::AdapterPositions;
using model::AdapterWeights;
using model::Model;

std::shared_ptr<const AdapterWeights> Load(const std::string& dir, const model::ModelConfig& c) {
  auto a = adapters::LoadAdapter(dir, c);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::shared_ptr<const AdapterWeights>(std::move(a).value()) : nullptr;
}

std::unique_ptr<Engine> MakeEngine(Model* m, int64_t kv_blocks = 256, int64_t batch_tokens = 512) {
  engine::EngineOptions o;
  o.kv_blocks = kv_blocks;
  o.scheduler.max_batch_tokens = batch_tokens;
  auto e = Engine::Create(m, nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(e).value();
}

Request MakeRequest(const std::string& id, std::vector<int32_t> prompt, int max_tokens,
                    std::shared_ptr<const AdapterWeights> adapter = nullptr,
                    std::optional<AdapterPositions> positions = std::nullopt) {
  Request r;
  r.id = id;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.sampling.logprobs = 5;
  r.adapter.weights = std::move(adapter);
  r.adapter.name = id;
  r.adapter.positions = positions;
  return r;
}

std::vector<GenerationResult> RunAll(Engine* e, std::vector<Request> reqs) {
  auto out = e->Generate(std::move(reqs));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? std::move(out).value() : std::vector<GenerationResult>{};
}

// Tokens equal and the chosen and top-5 logprobs within `tol`.
void ExpectSameGeneration(const GenerationResult& got, const GenerationResult& want, double tol,
                          const std::string& what) {
  ASSERT_EQ(got.token_ids, want.token_ids) << what;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    EXPECT_NEAR(got.logprobs[i].logprob, want.logprobs[i].logprob, tol) << what << " step " << i;
    for (size_t k = 0; k < got.logprobs[i].top.size(); ++k) {
      EXPECT_EQ(got.logprobs[i].top[k].first, want.logprobs[i].top[k].first) << what;
      EXPECT_NEAR(got.logprobs[i].top[k].second, want.logprobs[i].top[k].second, tol) << what;
    }
  }
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/preft_adapter_engine_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A random model of the tiny preset, written under `dir` and loaded.
std::unique_ptr<Model> MakeTinyModel(const std::string& dir, kernels::DType dtype, uint64_t seed) {
  model::MakeModelOptions mo;
  mo.preset = "tiny";
  mo.dtype = dtype;
  mo.seed = seed;
  mo.out_dir = dir + "/model";
  EXPECT_TRUE(model::MakeModel(mo).ok());
  auto m = Model::Load(mo.out_dir);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

// A copy of the fixture model with every LoRA module merged: W += s * B A.
std::string WriteMergedModel(const std::string& base_dir, const AdapterWeights& lora,
                             const std::string& out_dir) {
  auto file = model::SafetensorsFile::Open(base_dir + "/model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  std::map<std::string, std::vector<float>> values;
  for (const auto& [name, t] : (*file)->tensors()) {
    std::vector<float>& v = values[name];
    v.resize(t.num_elements());
    for (size_t i = 0; i < v.size(); ++i) v[i] = kernels::LoadAsF32(t.data, t.dtype, i);
  }
  for (int64_t l = 0; l < lora.num_layers(); ++l) {
    for (int p = 0; p < model::kNumProjections; ++p) {
      const auto proj = static_cast<model::Projection>(p);
      const model::LowRank& lr = lora.lora(l, proj);
      if (lr.empty()) continue;
      const bool attn = p <= static_cast<int>(model::Projection::kO);
      const std::string name = "model.layers." + std::to_string(l) +
                               (attn ? ".self_attn." : ".mlp.") + model::ProjectionName(proj) +
                               ".weight";
      std::vector<float>& w = values.at(name);
      const int64_t out = lr.expand.cols, in = lr.shrink.cols;
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double s = 0;
          for (int64_t k = 0; k < lr.rank(); ++k)
            s += double(kernels::LoadAsF32(lr.expand.data, lr.expand.dtype, k * out + o)) *
                 kernels::LoadAsF32(lr.shrink.data, lr.shrink.dtype, k * in + i);
          w[o * in + i] += static_cast<float>(lr.scale * s);
        }
    }
  }
  std::vector<model::TensorToWrite> tensors;
  for (const auto& [name, t] : (*file)->tensors())
    tensors.push_back({name, kernels::DType::kF32, t.shape, values.at(name).data()});
  EXPECT_TRUE(model::WriteSafetensors(out_dir + "/model.safetensors", tensors).ok());
  fs::copy_file(base_dir + "/config.json", out_dir + "/config.json",
                fs::copy_options::overwrite_existing);
  return out_dir;
}

// Greedy generation where the prompt's KV comes from `prefill_model` (with `adapter` on every
// prompt token, if given) and every generated token runs on `decode_model` without adapter:
// the definition of PreFT, built directly on Model::Forward.
GenerationResult PrefillThenBaseDecode(Model* prefill_model, const AdapterWeights* adapter,
                                       Model* decode_model, const std::vector<int32_t>& prompt,
                                       int max_tokens) {
  const model::ModelConfig& c = decode_model->config();
  auto cache = kv::KvCache::Create(decode_model->CacheShape(16));
  EXPECT_TRUE(cache.ok());
  std::vector<int32_t> blocks(16);
  for (int32_t i = 0; i < 16; ++i) blocks[i] = i;
  GenerationResult r;
  base::AlignedVector<float> logits;
  std::vector<int32_t> tokens = prompt;
  model::ForwardBatch prefill;
  prefill.AddSequence(blocks.data(), 16, prompt.data(), static_cast<int64_t>(prompt.size()),
                      static_cast<int64_t>(prompt.size()), true, adapter, nullptr);
  EXPECT_TRUE(prefill_model->Forward(prefill, cache->get(), &logits).ok());
  for (int step = 0; step < max_tokens; ++step) {
    const engine::TokenLogprob lp = engine::ComputeLogprobs(logits.data(), c.vocab_size, -1, 5);
    const int32_t next = lp.top[0].first;
    r.token_ids.push_back(next);
    r.logprobs.push_back(engine::ComputeLogprobs(logits.data(), c.vocab_size, next, 5));
    tokens.push_back(next);
    if (step + 1 == max_tokens) break;
    model::ForwardBatch decode;
    decode.AddSequence(blocks.data(), 16, &tokens.back(), 1, static_cast<int64_t>(tokens.size()),
                       true);
    EXPECT_TRUE(decode_model->Forward(decode, cache->get(), &logits).ok());
  }
  return r;
}

class AdapterEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = Model::Load(testing::TinyLlamaFixture());
    ASSERT_TRUE(m.ok()) << m.status();
    base_ = std::move(m).value().release();
  }
  static Model* base_;
};
Model* AdapterEngineTest::base_ = nullptr;

const std::vector<std::vector<int32_t>> kPrompts = {
    {5, 9, 200},
    {17, 5, 99, 23, 8, 41, 7, 2, 250, 12, 64, 3, 3, 90, 91, 92, 93, 11},  // crosses a KV block
    {1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18,
     19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35}};

// Every case of the fixture's reference.json (base, lora, lora_rs, lorap, direft, direftp),
// first one request at a time, then all of them in one heterogeneous batch.
TEST_F(AdapterEngineTest, ReproducesEveryFixtureMode) {
  const std::string dir = testing::TinyLlamaFixture();
  auto text = base::ReadFileToString(dir + "/reference.json");
  ASSERT_TRUE(text.ok());
  const nlohmann::json ref = nlohmann::json::parse(*text);
  std::map<std::string, std::shared_ptr<const AdapterWeights>> adapters;
  std::vector<Request> reqs;
  std::vector<GenerationResult> want;
  std::map<std::string, int> modes;
  for (const auto& c : ref["cases"]) {
    std::shared_ptr<const AdapterWeights> a;
    std::optional<AdapterPositions> pos;
    if (!c["adapter"].is_null()) {
      const std::string name = c["adapter"];
      if (!adapters.count(name)) adapters[name] = Load(dir + "/" + name, base_->config());
      a = adapters[name];
      AdapterPositions p;
      ASSERT_TRUE(model::ParseAdapterPositions(c["adapter_positions"], &p));
      pos = p;
    }
    ++modes[c["mode"]];
    const std::string id = "case" + std::to_string(reqs.size());
    reqs.push_back(
        MakeRequest(id, c["prompt_ids"], static_cast<int>(c["token_ids"].size()), a, pos));
    GenerationResult w;
    w.token_ids = c["token_ids"].get<std::vector<int32_t>>();
    for (const auto& s : c["logprobs"]) {
      engine::TokenLogprob lp;
      lp.token_id = s["token_id"];
      lp.logprob = s["logprob"];
      for (const auto& t : s["top"]) lp.top.push_back({t[0].get<int32_t>(), t[1].get<double>()});
      w.logprobs.push_back(lp);
    }
    want.push_back(std::move(w));
  }
  EXPECT_EQ(modes.size(), 6u);
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto e = MakeEngine(base_);
    const auto got = RunAll(e.get(), {reqs[i]});
    ASSERT_EQ(got.size(), 1u);
    ExpectSameGeneration(got[0], want[i], 1e-4,
                         "alone: " + ref["cases"][i]["mode"].get<std::string>());
  }
  auto e = MakeEngine(base_, 256, 32);  // small chunks: prompts split across steps
  const auto got = RunAll(e.get(), reqs);
  ASSERT_EQ(got.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i)
    ExpectSameGeneration(got[i], want[i], 1e-4,
                         "batched: " + ref["cases"][i]["mode"].get<std::string>());
}

// All-position LoRA is the base model with merged weights W + s·BA.
TEST_F(AdapterEngineTest, AllPositionLoraEqualsMergedWeights) {
  const std::string fixture = testing::TinyLlamaFixture();
  for (const char* name : {"lora", "lora_rs"}) {
    auto lora = Load(fixture + "/" + name, base_->config());
    ASSERT_TRUE(lora);
    auto merged =
        Model::Load(WriteMergedModel(fixture, *lora, TempDir(std::string("merged_") + name)));
    ASSERT_TRUE(merged.ok()) << merged.status();
    auto e_base = MakeEngine(base_);
    auto e_merged = MakeEngine(merged->get());
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      const auto got =
          RunAll(e_base.get(), {MakeRequest("a", kPrompts[i], 16, lora, AdapterPositions::kAll)});
      const auto want = RunAll(e_merged.get(), {MakeRequest("m", kPrompts[i], 16)});
      ExpectSameGeneration(got.at(0), want.at(0), 1e-4,
                           std::string(name) + " prompt " + std::to_string(i));
    }
  }
}

// LoRAP: the first token is the merged model's; every later step equals a run whose prompt KV
// comes from the merged model and whose decode uses the base weights.
TEST_F(AdapterEngineTest, LorapEqualsMergedPrefillThenBaseDecode) {
  const std::string fixture = testing::TinyLlamaFixture();
  auto lora = Load(fixture + "/lora", base_->config());
  ASSERT_TRUE(lora);
  auto merged = Model::Load(WriteMergedModel(fixture, *lora, TempDir("merged_lorap")));
  ASSERT_TRUE(merged.ok());
  auto e = MakeEngine(base_);
  auto e_merged = MakeEngine(merged->get());
  const double adapter_seconds = base_->adapter_seconds();
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    const auto got =
        RunAll(e.get(), {MakeRequest("p", kPrompts[i], 16, lora, AdapterPositions::kPrompt)});
    const auto merged_run = RunAll(e_merged.get(), {MakeRequest("m", kPrompts[i], 1)});
    EXPECT_EQ(got.at(0).token_ids.at(0), merged_run.at(0).token_ids.at(0));
    const GenerationResult want =
        PrefillThenBaseDecode(merged->get(), nullptr, base_, kPrompts[i], 16);
    ExpectSameGeneration(got.at(0), want, 1e-4, "lorap prompt " + std::to_string(i));
    // And it is a different generation from all-position LoRA (the mask matters).
    const auto all =
        RunAll(e.get(), {MakeRequest("a", kPrompts[i], 16, lora, AdapterPositions::kAll)});
    EXPECT_NE(all.at(0).token_ids, got.at(0).token_ids) << "prompt " << i;
  }
  // The adapters' products are timed (adapter_bench reads it); a model that ran none, none.
  EXPECT_GT(base_->adapter_seconds(), adapter_seconds);
  EXPECT_EQ((*merged)->adapter_seconds(), 0.0);
}

// DiReFTP: the intervention on prompt positions only, then plain base decode.
TEST_F(AdapterEngineTest, DireftpEqualsAdaptedPrefillThenBaseDecode) {
  auto direft = Load(testing::TinyLlamaFixture() + "/direft", base_->config());
  ASSERT_TRUE(direft);
  auto e = MakeEngine(base_);
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    const auto got =
        RunAll(e.get(), {MakeRequest("p", kPrompts[i], 16, direft, AdapterPositions::kPrompt)});
    const GenerationResult want =
        PrefillThenBaseDecode(base_, direft.get(), base_, kPrompts[i], 16);
    ExpectSameGeneration(got.at(0), want, 1e-4, "direftp prompt " + std::to_string(i));
    const auto all =
        RunAll(e.get(), {MakeRequest("a", kPrompts[i], 16, direft, AdapterPositions::kAll)});
    EXPECT_NE(all.at(0).token_ids, got.at(0).token_ids) << "prompt " << i;
  }
}

// A request's tokens are the same alone and inside a batch of 32 requests on 32 different
// adapters (LoRA of mixed ranks and targets, DiReFT, prompt and all positions) plus base-only
// requests, greedy and seeded; also when the KV cache is small enough to force preemptions.
TEST_F(AdapterEngineTest, TokensAreIdenticalAloneAndAmong32Adapters) {
  const std::string dir = TempDir("batch32");
  const std::unique_ptr<Model> m = MakeTinyModel(dir, kernels::DType::kF32, 3);
  ASSERT_TRUE(m);
  const model::ModelConfig& c = m->config();

  std::vector<Request> reqs;
  for (int i = 0; i < 40; ++i) {
    std::shared_ptr<const AdapterWeights> a;
    std::optional<AdapterPositions> pos;
    if (i < 32) {
      adapters::RandomAdapterSpec spec;
      spec.seed = 100 + i;
      if (i % 2 == 0) {
        spec.kind = model::AdapterKind::kLora;
        spec.rank = (i % 3 == 0) ? 4 : (i % 3 == 1) ? 8 : 16;
        if (i % 4 == 0) spec.targets = {model::Projection::kQ, model::Projection::kV};
      } else {
        spec.kind = model::AdapterKind::kDireft;
        spec.rank = (i % 4 == 1) ? 2 : 4;
        if (i % 8 == 3) spec.prompt_positions = "f3+l2";
      }
      const std::string adir = dir + "/adapter" + std::to_string(i);
      ASSERT_TRUE(adapters::WriteRandomAdapter(c, spec, adir).ok());
      a = Load(adir, c);
      ASSERT_TRUE(a);
      pos = (i % 3 == 0) ? AdapterPositions::kAll : AdapterPositions::kPrompt;
    }
    std::vector<int32_t> prompt;
    const int n = 3 + (i * 7) % 40;
    for (int k = 0; k < n; ++k)
      prompt.push_back((k * 31 + i * 17) % static_cast<int>(c.vocab_size - 2));
    Request r = MakeRequest("r" + std::to_string(i), prompt, 12, a, pos);
    r.sampling.logprobs.reset();
    if (i % 2 == 1) {  // seeded sampling for half of them
      r.sampling.temperature = 0.9f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 1000 + i;
    }
    reqs.push_back(std::move(r));
  }
  std::vector<std::vector<int32_t>> alone;
  for (const Request& r : reqs) {
    auto e = MakeEngine(m.get());
    alone.push_back(RunAll(e.get(), {r}).at(0).token_ids);
  }
  // Adapters must matter for this to mean anything: most adapted requests differ from base.
  int differs = 0;
  for (int i = 0; i < 32; ++i) {
    Request base = reqs[i];
    base.adapter = {};
    auto e = MakeEngine(m.get());
    differs += RunAll(e.get(), {base}).at(0).token_ids != alone[i];
  }
  EXPECT_GE(differs, 24);

  for (int64_t kv_blocks : {256, 24}) {  // 24 blocks: preemption and recomputation
    auto e = MakeEngine(m.get(), kv_blocks, 64);
    const auto together = RunAll(e.get(), reqs);
    ASSERT_EQ(together.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i)
      EXPECT_EQ(together[i].token_ids, alone[i]) << reqs[i].id << " kv_blocks " << kv_blocks;
    if (kv_blocks == 24) {
      EXPECT_GT(e->stats().preemptions, 0);
    }
  }
}

// Adapters loaded in the CPU kernels' chunked layout (what a CPU worker's store does) generate
// what the row-major ones do: tokens and logprobs, prompt and decode rows, LoRA and DiReFT,
// prompt-only and all positions, in one mixed batch. Exactly for ranks 4 and 8; rank 16's
// shrinks are stored by column pairs and sum in another order (kernels::ColumnPaired), so
// their logprobs agree to rounding.
TEST_F(AdapterEngineTest, CpuLayoutAdaptersGenerateTheRowMajorOnes) {
  const std::string dir = TempDir("cpu_layout");
  const std::unique_ptr<Model> m = MakeTinyModel(dir, kernels::DType::kBF16, 5);
  ASSERT_TRUE(m);
  const model::ModelConfig& c = m->config();
  std::vector<Request> row_major, chunked;
  std::vector<int64_t> ranks;
  bool any_chunked = false;
  for (int i = 0; i < 10; ++i) {
    adapters::RandomAdapterSpec spec;
    spec.seed = 300 + i;
    spec.dtype = kernels::DType::kBF16;
    spec.kind = i % 3 == 2 ? model::AdapterKind::kDireft : model::AdapterKind::kLora;
    // LoRA of ranks 4, 8 and 16 in turn.
    spec.rank = spec.kind == model::AdapterKind::kDireft ? 4 : 4 << ((i / 3 + i % 3) % 3);
    ranks.push_back(spec.rank);
    const std::string adir = dir + "/adapter" + std::to_string(i);
    ASSERT_TRUE(adapters::WriteRandomAdapter(c, spec, adir).ok());
    adapters::LoadOptions lo;
    lo.dtype = kernels::DType::kBF16;
    auto plain = adapters::LoadAdapter(adir, c, lo);
    lo.cpu_layout = true;
    auto cpu = adapters::LoadAdapter(adir, c, lo);
    ASSERT_TRUE(plain.ok() && cpu.ok());
    const model::LowRank& lr = spec.kind == model::AdapterKind::kLora
                                   ? (*cpu)->lora(0, model::Projection::kGate)
                                   : (*cpu)->direft(0);
    any_chunked |= lr.shrink.chunked;
    EXPECT_EQ(lr.shrink.chunked, kernels::cpu::LowRankChunkable(lr.shrink));
    std::vector<int32_t> prompt;
    for (int k = 0; k < 5 + 9 * i; ++k) prompt.push_back((k * 13 + i * 29) % 290);
    const auto pos = i % 2 == 0 ? AdapterPositions::kAll : AdapterPositions::kPrompt;
    row_major.push_back(MakeRequest("r" + std::to_string(i), prompt, 10,
                                    std::shared_ptr<const AdapterWeights>(*std::move(plain)), pos));
    chunked.push_back(MakeRequest("r" + std::to_string(i), prompt, 10,
                                  std::shared_ptr<const AdapterWeights>(*std::move(cpu)), pos));
  }
  if (kernels::cpu::ActiveLinearIsa() >= kernels::cpu::LinearIsa::kAvx512Bf16) {
    EXPECT_TRUE(any_chunked);
  }
  auto a = MakeEngine(m.get()), b = MakeEngine(m.get());
  const auto want = RunAll(a.get(), row_major);
  const auto got = RunAll(b.get(), chunked);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ExpectSameGeneration(got[i], want[i], ranks[i] % 16 == 0 ? 2e-3 : 0.0, row_major[i].id);
  }
}

// Batch invariance, bit for bit: a request generates the same tokens and logprobs alone and
// in a busy batch, whatever shares its step. The batch mixes base-only requests, LoRA (chunked
// and row-major layouts, two ranks) and DiReFT, prompt-only and all positions, greedy and
// seeded sampling, several users per adapter (so a row's adapter group has one row alone and
// several together), and a small token budget chunks its prompts beside decode rows; alone,
// each prompt is one chunk. Every linear, low-rank product and attention row must therefore
// sum in an order that depends on nothing but its own row.
TEST_F(AdapterEngineTest, RequestsGenerateBitForBitAsTheyDoAlone) {
  for (const kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kF32}) {
    SCOPED_TRACE(kernels::DTypeName(dtype));
    const std::string dir = TempDir(std::string("invariant_") + kernels::DTypeName(dtype));
    const std::unique_ptr<Model> m = MakeTinyModel(dir, dtype, 9);
    ASSERT_TRUE(m);
    const model::ModelConfig& c = m->config();
    std::vector<std::shared_ptr<const AdapterWeights>> adapters;
    for (int a = 0; a < 4; ++a) {
      adapters::RandomAdapterSpec spec;
      spec.seed = 500 + a;
      spec.dtype = dtype;
      spec.kind = a == 3 ? model::AdapterKind::kDireft : model::AdapterKind::kLora;
      spec.rank = a == 3 ? 4 : a == 2 ? 8 : 16;
      const std::string adir = dir + "/adapter" + std::to_string(a);
      ASSERT_TRUE(adapters::WriteRandomAdapter(c, spec, adir).ok());
      adapters::LoadOptions lo;
      lo.dtype = dtype;
      lo.cpu_layout = a != 1;  // chunked where this CPU's kernels take it; row-major for one
      auto w = adapters::LoadAdapter(adir, c, lo);
      ASSERT_TRUE(w.ok()) << w.status();
      adapters.emplace_back(*std::move(w));
    }
    std::vector<Request> reqs;
    for (int i = 0; i < 18; ++i) {
      std::vector<int32_t> prompt;
      for (int k = 0; k < 4 + 5 * (i % 7) + i / 7; ++k) prompt.push_back((k * 11 + i * 37) % 290);
      const int a = i % 5;  // 4: base only
      Request r = MakeRequest(absl::StrCat("r", i), prompt, 12,
                              a < 4 ? adapters[a] : nullptr,
                              a == 4 ? std::nullopt
                                     : std::optional(i % 2 ? AdapterPositions::kAll
                                                           : AdapterPositions::kPrompt));
      if (i % 3 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = 40 + i;
      }
      reqs.push_back(std::move(r));
    }
    auto e = MakeEngine(m.get(), 256, /*batch_tokens=*/24);
    const auto together = RunAll(e.get(), reqs);
    ASSERT_EQ(together.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto solo = MakeEngine(m.get());
      ExpectSameGeneration(together[i], RunAll(solo.get(), {reqs[i]}).at(0), 0.0, reqs[i].id);
    }
  }
}

// A CPU backend whose adapter copies take a while, as a GPU's do: AdapterReady says no to its
// first `not_ready_queries` questions about each adapter. Forward counts batches that name an
// adapter before it was ready, and steps run while one was not.
class SlowAdapterBackend : public backend::ForwardBackend {
 public:
  SlowAdapterBackend(std::unique_ptr<backend::CpuBackend> cpu, int not_ready_queries)
      : cpu_(std::move(cpu)), not_ready_queries_(not_ready_queries) {}
  const model::ModelConfig& config() const override { return cpu_->config(); }
  const kv::KvCacheShape& cache_shape() const override { return cpu_->cache_shape(); }
  absl::Status Forward(const model::ForwardBatch& batch,
                       base::AlignedVector<float>* logits) override {
    int64_t t = 0;
    for (const auto& s : batch.sequences) {
      if (s.adapter != nullptr && !ready_.count(s.adapter)) ++early_uses;
      if (s.adapter != nullptr &&
          std::none_of(batch.adapter_mask.begin() + t, batch.adapter_mask.begin() + t + s.num_new,
                       [](uint8_t m) { return m != 0; })) {
        ++idle_adapter_uses;
      }
      t += s.num_new;
    }
    if (ready_.size() < queries_.size()) ++steps_while_copying;
    return cpu_->Forward(batch, logits);
  }
  void PrepareAdapter(const std::shared_ptr<const AdapterWeights>& a) override {
    ++prepared[a.get()];
  }
  absl::StatusOr<bool> AdapterReady(const std::shared_ptr<const AdapterWeights>& a) override {
    if (a.get() == broken) return absl::ResourceExhaustedError("no device memory for adapter");
    if (++queries_[a.get()] <= not_ready_queries_) return false;
    ready_.insert(a.get());
    return true;
  }
  kernels::DType adapter_dtype() const override { return cpu_->adapter_dtype(); }
  kv::KvCache* host_cache() override { return cpu_->host_cache(); }
  const char* name() const override { return "cpu-slow-adapters"; }

  int early_uses = 0;
  int idle_adapter_uses = 0;  // an adapter named by rows it applies to none of
  int steps_while_copying = 0;
  std::map<const AdapterWeights*, int> prepared;
  const AdapterWeights* broken = nullptr;  // AdapterReady fails for it

 private:
  std::unique_ptr<backend::CpuBackend> cpu_;
  int not_ready_queries_;
  std::map<const AdapterWeights*, int> queries_;
  std::set<const AdapterWeights*> ready_;
};

// An adapter still being copied delays its own request only: the engine starts the copy when
// the request is queued, admits the prompt once the backend says the adapter is ready, and
// meanwhile keeps stepping the others (a base request, and one whose adapter is ready). No
// batch names an adapter early, and every request's tokens are what it gets alone.
// An engine on `m` over a SlowAdapterBackend, which *backend borrows.
std::unique_ptr<Engine> SlowAdapterEngine(Model* m, int not_ready_queries,
                                          SlowAdapterBackend** backend) {
  auto cpu = backend::CpuBackend::Create(m, 256, 16);
  EXPECT_TRUE(cpu.ok());
  auto owned = std::make_unique<SlowAdapterBackend>(*std::move(cpu), not_ready_queries);
  *backend = owned.get();
  auto e = Engine::Create(std::move(owned), nullptr, engine::EngineOptions{});
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

// A base request, a LoRAP one and a DiReFTP one on the fixture's adapters.
struct ThreeRequests {
  std::shared_ptr<const AdapterWeights> lora, direft;
  std::vector<Request> reqs;
};
ThreeRequests MakeThreeRequests(const model::ModelConfig& c) {
  const std::string fixture = testing::TinyLlamaFixture();
  ThreeRequests t{Load(fixture + "/lora", c), Load(fixture + "/direft", c), {}};
  t.reqs = {MakeRequest("base", kPrompts[1], 16),
            MakeRequest("lorap", kPrompts[2], 8, t.lora, AdapterPositions::kPrompt),
            MakeRequest("direftp", kPrompts[0], 8, t.direft, AdapterPositions::kPrompt)};
  return t;
}

TEST_F(AdapterEngineTest, AnAdapterStillCopyingDelaysOnlyItsOwnRequest) {
  const auto [lora, direft, reqs] = MakeThreeRequests(base_->config());
  ASSERT_TRUE(lora && direft);
  std::vector<std::vector<int32_t>> alone;
  for (const Request& r : reqs) {
    auto e = MakeEngine(base_);
    alone.push_back(RunAll(e.get(), {r}).at(0).token_ids);
  }
  SlowAdapterBackend* backend = nullptr;
  auto e = SlowAdapterEngine(base_, /*not_ready_queries=*/6, &backend);
  ASSERT_NE(e, nullptr);
  const auto together = RunAll(e.get(), reqs);
  ASSERT_EQ(together.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(together[i].token_ids, alone[i]) << i;
  EXPECT_EQ(backend->early_uses, 0);
  EXPECT_EQ(backend->idle_adapter_uses, 0);  // PreFT decode rows name no adapter
  EXPECT_GE(backend->steps_while_copying, 5);  // the base request went on meanwhile
  EXPECT_EQ(backend->prepared[lora.get()], 1);  // once, when queued
  EXPECT_EQ(backend->prepared[direft.get()], 1);
}

// An adapter the backend cannot prepare (a GPU without memory for its copy) fails the request
// naming it with the backend's error; the requests beside it finish as they would alone.
TEST_F(AdapterEngineTest, AnAdapterThatCannotBePreparedFailsOnlyItsRequest) {
  const auto [lora, direft, reqs] = MakeThreeRequests(base_->config());
  ASSERT_TRUE(lora && direft);
  SlowAdapterBackend* backend = nullptr;
  auto e = SlowAdapterEngine(base_, /*not_ready_queries=*/2, &backend);
  ASSERT_NE(e, nullptr);
  backend->broken = lora.get();
  const auto together = RunAll(e.get(), reqs);
  ASSERT_EQ(together.size(), reqs.size());
  EXPECT_EQ(together[1].finish, engine::FinishReason::kError);
  EXPECT_EQ(together[1].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(together[1].status.message().find("no device memory"), std::string::npos);
  EXPECT_TRUE(together[1].token_ids.empty());
  for (size_t i : {size_t{0}, size_t{2}}) {
    auto alone = MakeEngine(base_);
    EXPECT_TRUE(together[i].status.ok()) << together[i].status;
    EXPECT_EQ(together[i].token_ids, RunAll(alone.get(), {reqs[i]}).at(0).token_ids) << i;
  }
  EXPECT_GT(e->stats().steps, 0);
}

// The multi-LoRA baseline's disaggregated decode: a sequence imported with an all-position
// adapter waits for the adapter's copy without holding up the imported base sequence beside
// it, and both decode what one engine gives them.
TEST_F(AdapterEngineTest, AnImportedSequenceWaitsForItsAdapterAlone) {
  auto lora = Load(testing::TinyLlamaFixture() + "/lora", base_->config());
  ASSERT_TRUE(lora);
  const std::vector<Request> reqs = {
      MakeRequest("base", kPrompts[1], 10),
      MakeRequest("lora-all", kPrompts[2], 10, lora, AdapterPositions::kAll)};
  std::map<std::string, std::vector<int32_t>> want;
  for (const Request& r : reqs) {
    auto e = MakeEngine(base_);
    want[r.id] = RunAll(e.get(), {r}).at(0).token_ids;
  }
  auto prefill = MakeEngine(base_);
  std::vector<engine::PrefilledPrompt> handed;
  for (Request r : reqs) {
    r.on_prefilled = [&](const engine::PrefilledPrompt& p) { handed.push_back(p); };
    ASSERT_TRUE(prefill->Add(std::move(r)).ok());
  }
  while (prefill->HasWork()) ASSERT_TRUE(prefill->Step().ok());
  ASSERT_EQ(handed.size(), reqs.size());

  SlowAdapterBackend* backend = nullptr;
  auto decode = SlowAdapterEngine(base_, /*not_ready_queries=*/4, &backend);
  ASSERT_NE(decode, nullptr);
  const int64_t block_bytes = prefill->cache()->shape().block_bytes();
  std::vector<Request> imported;
  for (const engine::PrefilledPrompt& p : handed) {
    auto blocks = decode->ReserveBlocks((p.num_tokens + 10 + 15) / 16);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    for (int64_t l = 0; l < base_->config().num_layers; ++l) {
      for (size_t b = 0; b < p.blocks.size(); ++b) {
        std::memcpy(decode->cache()->block_data(l, (*blocks)[b]),
                    prefill->cache()->block_data(l, p.blocks[b]), block_bytes);
      }
    }
    Request r = p.request_id == reqs[0].id ? reqs[0] : reqs[1];
    r.sampling.seed = p.seed;
    r.imported = engine::ImportedPrompt{*blocks, p.first_token, p.first_logprob};
    imported.push_back(std::move(r));
  }
  const auto got = RunAll(decode.get(), imported);
  ASSERT_EQ(got.size(), imported.size());
  for (const GenerationResult& g : got) EXPECT_EQ(g.token_ids, want[g.request_id]) << g.request_id;
  EXPECT_EQ(backend->early_uses, 0);
  EXPECT_GE(backend->steps_while_copying, 3);  // the base sequence decoded meanwhile
}

TEST_F(AdapterEngineTest, ResultReportsAdapterVersionAndPositions) {
  auto direft = Load(testing::TinyLlamaFixture() + "/direft", base_->config());
  ASSERT_TRUE(direft);
  auto e = MakeEngine(base_);
  Request r = MakeRequest("v", kPrompts[0], 2, direft, std::nullopt);
  r.adapter.name = "user-7";
  r.adapter.version = 3;
  const auto out = RunAll(e.get(), {r});
  EXPECT_EQ(out.at(0).adapter, "user-7");
  EXPECT_EQ(out.at(0).adapter_version, 3);
  ASSERT_TRUE(out.at(0).adapter_positions.has_value());
  EXPECT_EQ(*out.at(0).adapter_positions, direft->default_positions);
}

}  // namespace
}  // namespace preft

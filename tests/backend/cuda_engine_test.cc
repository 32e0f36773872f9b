// The engine over the CUDA backend against the engine over the CPU, on a fresh random bf16
// tiny model: greedy tokens of base, LoRA, LoRAP, DiReFT and DiReFTP requests batched
// together. Both backends round to bf16 but sum in different orders, so where the CPU's best
// two tokens are all but tied the GPU may take the other (as vLLM's check_logprobs_close
// allows): a request may then diverge, only to the CPU's runner-up, only at a near tie, and
// is compared no further. Labelled `gpu`; without a device the backend must refuse clearly.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "common/backend/cuda_backend.h"
#include "common/engine/engine.h"
#include "common/kernels/cuda/runtime.cuh"
#include "common/model/make_model.h"
#include "common/transport/cuda_ipc/cuda_ipc_transport.h"
#include "common/transport/ucx/ucx_transport.h"

namespace preft::engine {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) /
                       ("preft_cuda_engine_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// A fresh random bf16 tiny model in TempDir(name); *seed gets its seed.
std::unique_ptr<model::Model> FreshTinyModel(const std::string& name, uint64_t* seed,
                                             const std::string& preset = "tiny") {
  model::MakeModelOptions mo;
  mo.preset = preset;
  mo.dtype = kernels::DType::kBF16;
  mo.seed = *seed = std::random_device{}();
  mo.out_dir = TempDir(name);
  EXPECT_TRUE(model::MakeModel(mo).ok());
  auto host = model::Model::Load(mo.out_dir);
  EXPECT_TRUE(host.ok()) << host.status();
  return host.ok() ? *std::move(host) : nullptr;
}

// A random bf16 LoRA (rank 8) and DiReFT (rank 4) for `model`, written under TempDir(prefix
// + kind) and loaded as the GPU backend takes them. Empty on failure (the failure reported).
std::vector<std::shared_ptr<const model::AdapterWeights>> RandomAdapters(
    const model::Model& model, uint64_t seed, const std::string& prefix) {
  std::vector<std::shared_ptr<const model::AdapterWeights>> adapters;
  for (auto kind : {model::AdapterKind::kLora, model::AdapterKind::kDireft}) {
    adapters::RandomAdapterSpec spec;
    spec.kind = kind;
    spec.rank = kind == model::AdapterKind::kLora ? 8 : 4;
    spec.dtype = kernels::DType::kBF16;
    spec.seed = seed + 1;
    const std::string adir = TempDir(prefix + model::AdapterKindName(kind));
    const absl::Status written = adapters::WriteRandomAdapter(model.config(), spec, adir);
    EXPECT_TRUE(written.ok()) << written;
    adapters::LoadOptions lo;
    lo.dtype = kernels::DType::kBF16;
    auto a = adapters::LoadAdapter(adir, model.config(), lo);
    EXPECT_TRUE(a.ok()) << a.status();
    if (!written.ok() || !a.ok()) return {};
    adapters.push_back(std::move(*a));
  }
  return adapters;
}

// Five greedy requests (prompts of 9 to 37 random tokens, 12 new tokens): base, then LoRAP,
// LoRA, DiReFTP, DiReFT on RandomAdapters' two; with `logprobs` each token's top two.
std::vector<Request> MixedRequests(
    const std::vector<std::shared_ptr<const model::AdapterWeights>>& adapters, uint64_t seed,
    bool logprobs) {
  std::vector<Request> reqs;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int i = 0; i < 5; ++i) {
    Request r;
    r.id = "r" + std::to_string(i);
    for (int t = 0; t < 9 + 7 * i; ++t) r.prompt_ids.push_back(static_cast<int32_t>(rng() % 250));
    r.sampling.max_tokens = 12;
    r.sampling.ignore_eos = true;
    if (logprobs) r.sampling.logprobs = 2;  // the reference's margins, for near ties
    if (i > 0) {
      r.adapter.weights = adapters[(i - 1) / 2];
      r.adapter.positions =
          i % 2 == 1 ? model::AdapterPositions::kPrompt : model::AdapterPositions::kAll;
    }
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// `got` generated the tokens of `want` (which has each token's top-2 logprobs), but for a
// request that took want's runner-up at a near tie, compared no further from there.
// `near_tie`: nats between the reference's best two below which the other may take either.
void ExpectSameUpToNearTies(const std::vector<GenerationResult>& want,
                            const std::vector<GenerationResult>& got, double near_tie = 0.05) {
  ASSERT_EQ(got.size(), want.size());
  size_t diverged = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_TRUE(got[i].status.ok()) << got[i].status;
    const std::vector<int32_t>& w = want[i].token_ids;
    const std::vector<int32_t>& g = got[i].token_ids;
    ASSERT_EQ(g.size(), w.size());
    ASSERT_EQ(want[i].logprobs.size(), w.size());
    size_t j = 0;
    while (j < w.size() && g[j] == w[j]) ++j;
    if (j == w.size()) continue;
    const TokenLogprob& at = want[i].logprobs[j];
    ASSERT_GE(at.top.size(), 2u);
    const int32_t other = at.top[0].first == w[j] ? at.top[1].first : at.top[0].first;
    EXPECT_EQ(g[j], other) << "token " << j << ": not the reference's runner-up";
    EXPECT_LT(at.top[0].second - at.top[1].second, near_tie)
        << "token " << j << " differs where the reference's margin was clear";
    std::printf("request %zu: took the runner-up at token %zu (margin %.4f nats)\n", i, j,
                at.top[0].second - at.top[1].second);
    ++diverged;
  }
  EXPECT_LE(diverged, 2u) << "near ties are rare; flips in most requests are a bug";
}

TEST(CudaEngineTest, MixedAdapterRequestsMatchTheCpuEngine) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("model", &seed);
  ASSERT_NE(model, nullptr);

  auto gpu_backend = backend::CudaBackend::Create(*model, {});
  if (kernels::cuda::DeviceCount() == 0) {
    EXPECT_EQ(gpu_backend.status().code(), absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "no CUDA device visible";
  }
  ASSERT_TRUE(gpu_backend.ok()) << gpu_backend.status();
  EXPECT_EQ((*gpu_backend)->cache_shape().block_tokens, 16);

  const auto adapters = RandomAdapters(*model, seed, "");
  ASSERT_EQ(adapters.size(), 2u);
  EngineOptions o;
  o.kv_blocks = 64;
  auto cpu = Engine::Create(model.get(), nullptr, o);
  ASSERT_TRUE(cpu.ok());
  auto gpu = Engine::Create(*std::move(gpu_backend), nullptr, o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->cache(), nullptr);  // the KV cache lives on the device
  auto want = (*cpu)->Generate(MixedRequests(adapters, seed, true));
  auto got = (*gpu)->Generate(MixedRequests(adapters, seed, false));
  ASSERT_TRUE(want.ok() && got.ok());
  ExpectSameUpToNearTies(*want, *got);
}

// Tensor parallelism: the model split over two ranks (two GPUs through NCCL where there are
// two, else both ranks on one GPU summing through the host) generates the tokens one GPU
// does, for base, LoRA, LoRAP, DiReFT and DiReFTP requests batched together, through the
// logits path (logprobs asked) and the on-device sampling path. Qwen2's q/k/v biases are
// sliced with their heads.
TEST(CudaEngineTest, TensorParallelRanksGenerateAsOneGpu) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("tp_model", &seed, "tiny-qwen2");
  ASSERT_NE(model, nullptr);
  const int devices = kernels::cuda::DeviceCount();
  backend::CudaBackend::Options tp;
  tp.kv_blocks = 64;
  tp.tensor_parallel = 2;
  tp.ranks_share_device = devices < 2;
  if (devices == 0) {
    EXPECT_EQ(backend::CudaBackend::Create(*model, tp).status().code(),
              absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "no CUDA device visible";
  }
  // Splits the model cannot take, and more GPUs than there are, are refused.
  backend::CudaBackend::Options bad = tp;
  bad.tensor_parallel = 3;
  const absl::Status heads = backend::CudaBackend::Create(*model, bad).status();
  EXPECT_EQ(heads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.message().find("num_attention_heads (4) is not a multiple of 3"),
            std::string::npos) << heads;
  if (devices == 1) {  // two ranks of their own need two GPUs
    bad = tp;
    bad.ranks_share_device = false;
    const absl::Status too_few = backend::CudaBackend::Create(*model, bad).status();
    EXPECT_EQ(too_few.code(), absl::StatusCode::kFailedPrecondition) << too_few;
    EXPECT_NE(too_few.message().find("over 2 GPUs, but 1 visible"), std::string::npos) << too_few;
  }

  auto split = backend::CudaBackend::Create(*model, tp);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ((*split)->tensor_parallel(), 2);
  std::printf("tensor parallelism: 2 ranks through %s\n", (*split)->collective_kind());
  EXPECT_EQ((*split)->cache_shape().num_kv_heads, model->config().num_kv_heads);
  EXPECT_EQ((*split)->device_cache().base, nullptr);  // split over ranks: no single pool
  backend::CudaBackend::Options one;
  one.kv_blocks = 64;
  auto whole = backend::CudaBackend::Create(*model, one);
  ASSERT_TRUE(whole.ok()) << whole.status();

  const auto adapters = RandomAdapters(*model, seed, "tp_");
  ASSERT_EQ(adapters.size(), 2u);
  EngineOptions o;
  o.kv_blocks = 64;
  auto reference = Engine::Create(*std::move(whole), nullptr, o);
  auto engine = Engine::Create(*std::move(split), nullptr, o);
  ASSERT_TRUE(reference.ok() && engine.ok());
  auto want = (*reference)->Generate(MixedRequests(adapters, seed, true));
  ASSERT_TRUE(want.ok()) << want.status();
  for (bool logprobs : {true, false}) {
    SCOPED_TRACE(logprobs ? "logits to the host" : "sampled on the device");
    auto got = (*engine)->Generate(MixedRequests(adapters, seed, logprobs));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameUpToNearTies(*want, *got);
    if (!logprobs) continue;
    // Where the tokens agree, so do their logprobs (to bf16 rounding).
    for (size_t i = 0; i < want->size(); ++i) {
      const auto& w = (*want)[i];
      const auto& g = (*got)[i];
      for (size_t j = 0; j < w.token_ids.size() && g.token_ids[j] == w.token_ids[j]; ++j) {
        EXPECT_NEAR(g.logprobs[j].logprob, w.logprobs[j].logprob, 0.02)
            << "request " << i << " token " << j;
      }
    }
  }
}

// Three greedy requests with prompts of 20, 29 and 38 random tokens, 8 new tokens each: the
// split (prefill engine -> decode engine) tests' workload.
std::vector<Request> SplitRequests(uint64_t seed) {
  std::vector<Request> reqs;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int i = 0; i < 3; ++i) {
    Request r;
    r.id = "s" + std::to_string(i);
    for (int t = 0; t < 20 + 9 * i; ++t) r.prompt_ids.push_back(static_cast<int32_t>(rng() % 250));
    r.sampling.max_tokens = 8;
    r.sampling.ignore_eos = true;
    reqs.push_back(std::move(r));
  }
  return reqs;
}

Request RequestWithId(const std::vector<Request>& reqs, const std::string& id) {
  for (const Request& r : reqs) {
    if (r.id == id) return r;
  }
  ADD_FAILURE() << "no request " << id;
  return {};
}

// Disaggregated serving by hand: `reqs` are prefilled on `prefill`, each prompt's blocks are
// copied from its host mirror into blocks reserved in `decode`'s (the KV transport's memcpy),
// and the requests continue on `decode` as imported prompts (their tokens into `tokens`, when
// given) until it has no work left. On the way, what the import put on `decode`'s device is
// read back through its poisoned mirror: the prefill engine's blocks, bit for bit.
// *handed counts the prompts handed over.
void HandOverThroughMirrors(Engine* prefill, Engine* decode, const std::vector<Request>& reqs,
                            std::map<std::string, std::vector<int32_t>>* tokens,
                            size_t* handed_count) {
  std::vector<PrefilledPrompt> handed;
  for (Request r : reqs) {
    r.on_prefilled = [&](const PrefilledPrompt& p) { handed.push_back(p); };
    ASSERT_TRUE(prefill->Add(std::move(r)).ok());
  }
  while (prefill->HasWork()) ASSERT_TRUE(prefill->Step().ok());
  ASSERT_EQ(handed.size(), reqs.size());
  kv::KvCache* from = prefill->cache();
  kv::KvCache* to = decode->cache();
  ASSERT_TRUE(from != nullptr && to != nullptr);
  const int64_t block_bytes = from->shape().block_bytes();
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> moved;  // (src, dst)
  for (const PrefilledPrompt& p : handed) {
    auto blocks = decode->ReserveBlocks((p.num_tokens + 8 + 15) / 16);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    for (int64_t l = 0; l < from->shape().num_layers; ++l) {
      for (size_t b = 0; b < p.blocks.size(); ++b) {
        std::memcpy(to->block_data(l, (*blocks)[b]), from->block_data(l, p.blocks[b]),
                    block_bytes);
      }
    }
    moved.emplace_back(p.blocks,
                       std::vector<int32_t>(blocks->begin(), blocks->begin() + p.blocks.size()));
    Request r = RequestWithId(reqs, p.request_id);
    r.sampling.seed = p.seed;
    r.imported = ImportedPrompt{*blocks, p.first_token, p.first_logprob};
    if (tokens != nullptr) {
      r.on_token = [tokens](const TokenEvent& e) {
        if (e.token_id >= 0) (*tokens)[e.request_id].push_back(e.token_id);
      };
    }
    ASSERT_TRUE(decode->Add(std::move(r)).ok());  // copies the blocks to the device
  }
  // Poison the decode mirror, then read the device blocks back into it.
  for (int64_t l = 0; l < to->shape().num_layers; ++l) {
    std::memset(to->layer_data(l), 0xff, to->layer_bytes());
  }
  for (const auto& [src, dst] : moved) {
    ASSERT_TRUE(decode->backend().KvToHost(dst).ok());
    for (int64_t l = 0; l < from->shape().num_layers; ++l) {
      for (size_t b = 0; b < src.size(); ++b) {
        ASSERT_EQ(std::memcmp(to->block_data(l, dst[b]), from->block_data(l, src[b]), block_bytes),
                  0)
            << "layer " << l << " block " << dst[b];
      }
    }
  }
  while (decode->HasWork()) ASSERT_TRUE(decode->Step().ok());
  for (const PrefilledPrompt& p : handed) {
    ASSERT_TRUE(prefill->ReleasePrefilled(p.request_id).ok());
  }
  *handed_count = handed.size();
}

// Disaggregated serving on GPUs: a prefill engine's prompt blocks reach a decode engine's
// device cache through the two host mirrors (the KV transport's memcpy done here by hand),
// bit for bit, and the decode engine generates from them.
TEST(CudaEngineTest, PromptBlocksReachAnotherGpuEngineThroughHostMirrors) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("split_model", &seed);
  ASSERT_NE(model, nullptr);
  if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  backend::CudaBackend::Options bo;
  bo.kv_blocks = 64;
  bo.host_mirror = true;
  auto prefill_backend = backend::CudaBackend::Create(*model, bo);
  auto decode_backend = backend::CudaBackend::Create(*model, bo);
  ASSERT_TRUE(prefill_backend.ok() && decode_backend.ok());
  EngineOptions o;
  o.kv_blocks = 64;
  auto prefill = Engine::Create(*std::move(prefill_backend), nullptr, o);
  auto decode = Engine::Create(*std::move(decode_backend), nullptr, o);
  ASSERT_TRUE(prefill.ok() && decode.ok());
  ASSERT_NE((*prefill)->cache(), nullptr);  // the mirror
  size_t handed = 0;
  ASSERT_NO_FATAL_FAILURE(
      HandOverThroughMirrors(prefill->get(), decode->get(), SplitRequests(seed), nullptr, &handed));
  EXPECT_EQ(handed, 3u);
  EXPECT_EQ((*decode)->allocator().num_free(), 64);  // every imported sequence finished
}

// bf16 and fp8 KV on the GPU: the engine generates what the CPU engine with the same KV dtype
// does (both caches hold the same rounded values), near ties aside (wider for fp8: a K or V
// element the two devices compute a rounding apart can land a whole e4m3 step apart); the
// mirrored handoff between two GPU engines carries the narrow blocks.
TEST(CudaEngineTest, NarrowKvMatchesTheCpuEngineAndHandsOverThroughMirrors) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("narrow_kv_model", &seed);
  ASSERT_NE(model, nullptr);
  if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  const auto adapters = RandomAdapters(*model, seed, "narrow_kv_");
  ASSERT_EQ(adapters.size(), 2u);
  for (const auto& [dtype, near_tie] :
       {std::pair{kv::KvDtype::kBF16, 0.05}, {kv::KvDtype::kFp8E4M3, 0.3}}) {
    SCOPED_TRACE(std::string(kv::KvDtypeName(dtype)));
    backend::CudaBackend::Options bo;
    bo.kv_dtype = dtype;
    bo.kv_blocks = 64;
    bo.host_mirror = true;
    auto gpu_backend = backend::CudaBackend::Create(*model, bo);
    ASSERT_TRUE(gpu_backend.ok()) << gpu_backend.status();
    EXPECT_EQ((*gpu_backend)->cache_shape().dtype, dtype);
    EngineOptions o;
    o.kv_blocks = 64;
    o.kv_dtype = dtype;
    auto cpu = Engine::Create(model.get(), nullptr, o);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = Engine::Create(*std::move(gpu_backend), nullptr, o);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto want = (*cpu)->Generate(MixedRequests(adapters, seed, true));
    auto got = (*gpu)->Generate(MixedRequests(adapters, seed, false));
    ASSERT_TRUE(want.ok() && got.ok());
    ExpectSameUpToNearTies(*want, *got, near_tie);

    auto decode_backend = backend::CudaBackend::Create(*model, bo);
    ASSERT_TRUE(decode_backend.ok()) << decode_backend.status();
    auto decode = Engine::Create(*std::move(decode_backend), nullptr, o);
    ASSERT_TRUE(decode.ok());
    size_t handed = 0;
    ASSERT_NO_FATAL_FAILURE(
        HandOverThroughMirrors(gpu->get(), decode->get(), SplitRequests(seed), nullptr, &handed));
    EXPECT_EQ(handed, 3u);
    EXPECT_EQ((*decode)->allocator().num_free(), 64);
  }
}

// Tiers split differently hand KV through their host mirrors, which hold every KV head (each
// rank copies its own in or out): prompts prefilled on two ranks decode on one GPU, and
// prompts prefilled on one GPU decode on two ranks. Both generate the tokens one engine alone
// does (near ties aside), and what the decode tier imported is on its ranks' devices: read
// back through its mirror, bit for bit.
TEST(CudaEngineTest, TensorParallelTiersHandKvThroughHostMirrors) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("tp_split_model", &seed, "tiny-qwen2");
  ASSERT_NE(model, nullptr);
  const int devices = kernels::cuda::DeviceCount();
  if (devices == 0) GTEST_SKIP() << "no CUDA device visible";
  EngineOptions o;
  o.kv_blocks = 64;
  auto engine = [&](int tp, bool mirror) -> std::unique_ptr<Engine> {
    backend::CudaBackend::Options bo;
    bo.kv_blocks = 64;
    bo.host_mirror = mirror;
    bo.tensor_parallel = tp;
    bo.ranks_share_device = devices < tp;
    auto b = backend::CudaBackend::Create(*model, bo);
    EXPECT_TRUE(b.ok()) << b.status();
    if (!b.ok()) return nullptr;
    auto e = Engine::Create(*std::move(b), nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  };
  std::unique_ptr<Engine> alone = engine(1, false);
  ASSERT_NE(alone, nullptr);
  std::vector<Request> reference = SplitRequests(seed);
  for (Request& r : reference) r.sampling.logprobs = 2;  // margins, for near ties
  auto want = alone->Generate(reference);
  ASSERT_TRUE(want.ok()) << want.status();

  for (const auto& [prefill_tp, decode_tp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE("prefill on " + std::to_string(prefill_tp) + " ranks, decode on " +
                 std::to_string(decode_tp));
    std::unique_ptr<Engine> prefill = engine(prefill_tp, true), decode = engine(decode_tp, true);
    ASSERT_TRUE(prefill != nullptr && decode != nullptr);
    ASSERT_NE(prefill->cache(), nullptr);
    ASSERT_EQ(prefill->cache()->shape().num_kv_heads, model->config().num_kv_heads);  // all
    const std::vector<Request> reqs = SplitRequests(seed);
    std::map<std::string, std::vector<int32_t>> tokens;
    size_t handed = 0;
    ASSERT_NO_FATAL_FAILURE(
        HandOverThroughMirrors(prefill.get(), decode.get(), reqs, &tokens, &handed));
    ASSERT_EQ(handed, reqs.size());
    std::vector<GenerationResult> got(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) got[i].token_ids = tokens[reqs[i].id];
    ExpectSameUpToNearTies(*want, got);
    EXPECT_EQ(decode->allocator().num_free(), 64);
  }
}

// The same split with no host mirror: the prefill engine's prompt blocks reach the decode
// engine's device cache through CudaIpcTransport (device to device; DONE over UCX), and the
// decode engine generates exactly the tokens one engine alone generates for those requests.
TEST(CudaEngineTest, DecodeFromBlocksMovedGpuToGpuMatchesOneEngine) {
  uint64_t seed = 0;
  std::unique_ptr<model::Model> model = FreshTinyModel("ipc_model", &seed);
  ASSERT_NE(model, nullptr);
  if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  backend::CudaBackend::Options bo;
  bo.kv_blocks = 64;
  EngineOptions o;
  o.kv_blocks = 64;
  auto engine = [&] {
    auto backend = backend::CudaBackend::Create(*model, bo);
    EXPECT_TRUE(backend.ok()) << backend.status();
    auto e = Engine::Create(*std::move(backend), nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return *std::move(e);
  };
  std::unique_ptr<Engine> alone = engine(), prefill = engine(), decode = engine();
  ASSERT_EQ(prefill->cache(), nullptr);  // no mirror: the transport moves device memory
  const transport::KvLayout layout = transport::KvLayout::ForCache(prefill->backend().cache_shape(), "ipc");
  auto control = [] {
    transport::UcxTransportOptions uo;
    uo.tls = "posix,self";
    return std::make_unique<transport::UcxTransport>(uo);
  };
  transport::CudaIpcTransport sender(prefill->backend().device_cache(), control());
  transport::CudaIpcTransport receiver(decode->backend().device_cache(), control());
  absl::Mutex mu;
  std::set<uint64_t> noticed;
  ASSERT_TRUE(sender.Start(nullptr, layout, [](uint64_t, uint32_t) {}).ok());
  ASSERT_TRUE(receiver
                  .Start(nullptr, layout,
                         [&](uint64_t id, uint32_t) {
                           absl::MutexLock lock(&mu);
                           noticed.insert(id);
                         })
                  .ok());
  auto peer = sender.Connect(receiver.LocalAddress());
  ASSERT_TRUE(peer.ok()) << peer.status();

  std::map<std::string, std::vector<int32_t>> want, got;
  const std::vector<Request> reqs = SplitRequests(seed);
  std::vector<PrefilledPrompt> handed;
  for (Request r : reqs) {
    Request a = r;
    a.on_token = [&](const TokenEvent& e) {
      if (e.token_id >= 0) want[e.request_id].push_back(e.token_id);
    };
    ASSERT_TRUE(alone->Add(std::move(a)).ok());
    r.on_prefilled = [&](const PrefilledPrompt& p) { handed.push_back(p); };
    ASSERT_TRUE(prefill->Add(std::move(r)).ok());
  }
  while (alone->HasWork()) ASSERT_TRUE(alone->Step().ok());
  while (prefill->HasWork()) ASSERT_TRUE(prefill->Step().ok());
  ASSERT_EQ(handed.size(), reqs.size());
  uint64_t id = 0;
  for (const PrefilledPrompt& p : handed) {
    auto blocks = decode->ReserveBlocks((p.num_tokens + 8 + 15) / 16);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    transport::BlockTransfer t{++id, 1, p.blocks,
                               std::vector<int32_t>(blocks->begin(), blocks->begin() + p.blocks.size())};
    absl::Notification done;
    absl::Status status;
    sender.Write(*peer, t, [&](absl::Status s) {
      status = s;
      done.Notify();
    });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_TRUE(status.ok()) << status;
    Request r = RequestWithId(reqs, p.request_id);
    r.sampling.seed = p.seed;
    r.imported = ImportedPrompt{*blocks, p.first_token, p.first_logprob};
    r.on_token = [&](const TokenEvent& e) {
      if (e.token_id >= 0) got[e.request_id].push_back(e.token_id);
    };
    ASSERT_TRUE(decode->Add(std::move(r)).ok());
    ASSERT_TRUE(prefill->ReleasePrefilled(p.request_id).ok());
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(noticed.size(), handed.size());
  }
  while (decode->HasWork()) ASSERT_TRUE(decode->Step().ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(want.size(), 3u);
  EXPECT_EQ(decode->allocator().num_free(), 64);
}

}  // namespace
}  // namespace preft::engine

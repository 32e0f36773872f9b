#include "common/serving/worker_setup.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/model/make_model.h"
#include "tests/testing/fixtures.h"

namespace preft::serving {
namespace {

// The worker's flags after parsing "worker --model m" and `args`; nullopt where CLI11 refuses
// them.
std::optional<WorkerFlags> ParseWorkerFlags(std::vector<std::string> args) {
  CLI::App app;
  WorkerFlags f;
  AddWorkerFlags(app, &f);
  args.insert(args.begin(), {"worker", "--model", "m"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return std::nullopt;
  }
  return f;
}

TEST(WorkerSetupTest, FingerprintIsStableAndTellsCheckpointsApart) {
  auto a = LoadModel(testing::TinyLlamaFixture());
  auto b = LoadModel(testing::TinyLlamaFixture());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  EXPECT_EQ(a->fingerprint.rfind("LlamaForCausalLM-", 0), 0u) << a->fingerprint;
  EXPECT_NE(a->tokenizer, nullptr);
  const std::string dir = ::testing::TempDir() + "/fingerprint_model_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  model::MakeModelOptions m;
  m.preset = "tiny";
  m.out_dir = dir;
  ASSERT_TRUE(model::MakeModel(m).ok());
  auto c = LoadModel(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->fingerprint, a->fingerprint);
  EXPECT_FALSE(LoadModel(dir + "/missing").ok());
}

TEST(WorkerSetupTest, TransportFactoryAndReadinessCheck) {
  auto flags = [](const std::string& kind, const std::string& tls = "") {
    TransportFlags f;
    f.kind = kind;
    f.ucx_tls = tls;
    return f;
  };
  EXPECT_EQ(MakeTransport(flags("carrier-pigeon")).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto t = MakeTransport(flags("inproc"));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->name(), "inproc");
  const TransportFlags ucx = flags("ucx", "posix,self");
  EXPECT_TRUE(CheckTransport("ucx(posix,self)", ucx).ok());
  EXPECT_TRUE(CheckTransport("ucx(self,posix)", ucx).ok());
  const absl::Status fell_back = CheckTransport("ucx(tcp,self)", ucx);
  EXPECT_EQ(fell_back.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(fell_back.message().find("ucx(tcp,self)"), std::string::npos) << fell_back;
  EXPECT_FALSE(CheckTransport("ucx", ucx).ok());
  EXPECT_TRUE(CheckTransport("ucx(tcp,self)", flags("ucx")).ok());  // nothing configured
  EXPECT_TRUE(CheckTransport("ucx(posix,self)", flags("ucx", "shm,self")).ok());
  EXPECT_TRUE(CheckTransport("inproc", flags("inproc")).ok());
}

TEST(WorkerSetupTest, CudaIpcNeedsADeviceCacheAndIsCheckedAtReadiness) {
  TransportFlags f;
  f.kind = "cuda_ipc";
  const absl::Status no_device = MakeTransport(f).status();  // a CPU engine's cache
  EXPECT_EQ(no_device.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(no_device.message().find("--device cuda"), std::string::npos) << no_device;
  f.ucx_tls = "posix,self";
  EXPECT_TRUE(CheckTransport("cuda_ipc+ucx(posix,self)", f).ok());
  // The host path opened where the device path was asked for, or UCX fell back under it.
  const absl::Status host_path = CheckTransport("ucx(posix,self)", f);
  EXPECT_EQ(host_path.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(host_path.message().find("cuda_ipc"), std::string::npos) << host_path;
  EXPECT_EQ(CheckTransport("cuda_ipc+ucx(tcp,self)", f).code(),
            absl::StatusCode::kFailedPrecondition);
  f.ucx_tls.clear();
  EXPECT_TRUE(CheckTransport("cuda_ipc+ucx(tcp,self)", f).ok());
  EXPECT_FALSE(CheckTransport("inproc", f).ok());
}

// --tensor-parallel splits a model over GPUs: asked of the CPU, or with the transport that maps
// one GPU's pool, it is refused before anything is built; the flag takes 1 to 64.
TEST(WorkerSetupTest, TensorParallelNeedsGpusAndAHostMemoryTransport) {
  auto m = LoadModel(testing::TinyLlamaFixture());
  ASSERT_TRUE(m.ok()) << m.status();
  engine::EngineOptions o;
  o.kv_blocks = 16;
  const absl::Status cpu =
      MakeEngine(m->model.get(), m->tokenizer.get(), "cpu", o, false, 2).status();
  EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu.message(), "--tensor-parallel 2 splits the model over GPUs: use --device cuda");
  WorkerFlags ipc;
  ipc.model = testing::TinyLlamaFixture();
  ipc.device = "cuda";
  ipc.tensor_parallel = 4;
  ipc.transport.kind = "cuda_ipc";
  const absl::Status split = MakeWorkerEngine(ipc, /*kv_transport=*/true).status();
  EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(split.message(),
            "--transport cuda_ipc maps one GPU's KV pool; with --tensor-parallel 4 the KV is "
            "split over GPUs and moves through host memory: use --transport ucx");
  EXPECT_TRUE(MakeEngine(m->model.get(), m->tokenizer.get(), "cpu", o, false, 1).ok());

  for (const char* bad : {"0", "65", "two"}) {
    EXPECT_FALSE(ParseWorkerFlags({"--tensor-parallel", bad})) << bad;
  }
  const std::optional<WorkerFlags> f =
      ParseWorkerFlags({"--device", "cuda", "--tensor-parallel", "8"});
  ASSERT_TRUE(f);
  EXPECT_EQ(f->tensor_parallel, 8);
}

// --kv-dtype auto is the checkpoint's dtype (bf16 checkpoints: bf16 KV; f32: f32, so f32
// references stay exact); a worker's engine stores what the flag resolves to; fp8 only when
// asked for; unknown names are refused.
TEST(WorkerSetupTest, KvDtypeAutoFollowsTheCheckpoint) {
  using kernels::DType;
  EXPECT_EQ(*ResolveKvDtype("auto", DType::kBF16), kv::KvDtype::kBF16);
  EXPECT_EQ(*ResolveKvDtype("auto", DType::kF32), kv::KvDtype::kF32);
  EXPECT_EQ(*ResolveKvDtype("auto", DType::kF16), kv::KvDtype::kF32);
  EXPECT_EQ(*ResolveKvDtype("f32", DType::kBF16), kv::KvDtype::kF32);
  EXPECT_EQ(*ResolveKvDtype("bf16", DType::kF32), kv::KvDtype::kBF16);
  EXPECT_EQ(*ResolveKvDtype("fp8_e4m3", DType::kBF16), kv::KvDtype::kFp8E4M3);
  const absl::Status f16 = ResolveKvDtype("f16", DType::kF32).status();
  EXPECT_EQ(f16.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f16.message().find("expected auto, f32, bf16 or fp8_e4m3"), std::string::npos) << f16;

  const std::string dir = ::testing::TempDir() + "/kv_dtype_model_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  model::MakeModelOptions m;
  m.preset = "tiny";
  m.out_dir = dir;
  m.dtype = kernels::DType::kBF16;
  ASSERT_TRUE(model::MakeModel(m).ok());
  for (const auto& [flag, want] : {std::pair<std::string, kv::KvDtype>{"auto", kv::KvDtype::kBF16},
                                   {"f32", kv::KvDtype::kF32}}) {
    WorkerFlags f;
    f.model = dir;
    f.kv_blocks = 8;
    f.kv_dtype = flag;
    f.metrics_listen = "127.0.0.1:0";
    absl::StatusOr<WorkerEngine> w = MakeWorkerEngine(f, /*kv_transport=*/false);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->engine->backend().cache_shape().dtype, want) << flag;
    std::map<std::string, std::string> labels;  // of preft:cache_config_info
    for (const auto& family : w->metrics->registry().Collect()) {
      if (family.name != "preft:cache_config_info") continue;
      ASSERT_EQ(family.metric.size(), 1u);
      for (const auto& l : family.metric[0].label) labels[l.name] = l.value;
    }
    EXPECT_EQ(labels["kv_dtype"], want == kv::KvDtype::kBF16 ? "bf16" : "f32") << flag;
    EXPECT_EQ(labels["num_blocks"], "8");
    EXPECT_EQ(labels["block_tokens"], "16");
    EXPECT_EQ(labels["block_bytes"],
              absl::StrCat(w->engine->backend().cache_shape().bytes_per_block_all_layers()));
    w->engine.reset();  // before the metrics it reports to
  }
  EXPECT_FALSE(ParseWorkerFlags({"--kv-dtype", "f16"}));
  std::filesystem::remove_all(dir);
}

// --ucx-spin-us: 0 unless given (the progress thread sleeps at once: bench/NOTES.md step 33);
// a negative or non-numeric value is refused, and what is given reaches the transport's flags.
TEST(WorkerSetupTest, UcxSpinDefaultsToZeroAndIsValidated) {
  const std::optional<WorkerFlags> plain = ParseWorkerFlags({});
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->transport.ucx_spin_us, 0);
  for (const char* bad : {"-1", "lots", "2000000"}) {
    EXPECT_FALSE(ParseWorkerFlags({"--ucx-spin-us", bad})) << bad;
  }
  const std::optional<WorkerFlags> f = ParseWorkerFlags({"--ucx-spin-us", "250"});
  ASSERT_TRUE(f);
  EXPECT_EQ(f->transport.ucx_spin_us, 250);
}

}  // namespace
}  // namespace preft::serving

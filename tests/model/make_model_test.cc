#include "common/model/make_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "common/base/mapped_file.h"
#include "common/model/checkpoint.h"
#include "common/model/config.h"
#include "common/model/model.h"
#include "common/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using kernels::DType;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("preft_make_model_test_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(dir);
  return dir.string();
}

std::string Read(const std::string& path) {
  auto s = base::ReadFileToString(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : "";
}

absl::Status Make(const std::string& preset, DType dtype, uint64_t seed, const std::string& dir,
                  int64_t max_shard_bytes = int64_t{5} << 30) {
  MakeModelOptions o;
  o.preset = preset;
  o.dtype = dtype;
  o.seed = seed;
  o.out_dir = dir;
  o.max_shard_bytes = max_shard_bytes;
  return MakeModel(o);
}

// Reopens `dir` as the serving path would and checks every tensor against the config.
void ExpectLoadable(const std::string& dir, const ModelConfig& preset, DType dtype) {
  auto config = ModelConfig::FromFile(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, preset.architecture);
  EXPECT_EQ(config->hidden_size, preset.hidden_size);
  EXPECT_EQ(config->num_layers, preset.num_layers);
  EXPECT_EQ(config->attention_bias, preset.attention_bias);
  EXPECT_EQ(config->tie_word_embeddings, preset.tie_word_embeddings);
  EXPECT_EQ(config->torch_dtype, dtype);
  EXPECT_GE(config->bos_token_id, -1);
  ASSERT_EQ(config->eos_token_ids.size(), 1u);
  EXPECT_GE(config->eos_token_ids[0], 0);
  EXPECT_LT(config->eos_token_ids[0], config->vocab_size);

  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_TRUE((*ckpt)->CheckTensors(*config).ok()) << (*ckpt)->CheckTensors(*config);
  const auto expected = ExpectedTensors(*config);
  EXPECT_EQ((*ckpt)->tensors().size(), expected.size());
  for (const ExpectedTensor& e : expected) {
    const TensorInfo* t = *(*ckpt)->Get(e.name, e.shape);
    EXPECT_EQ(t->dtype, dtype) << e.name;
    const int64_t n = t->num_elements();
    double sum = 0, sum_sq = 0;
    for (int64_t i = 0; i < n; ++i) {
      double v = kernels::LoadAsF32(t->data, dtype, static_cast<size_t>(i));
      sum += v;
      sum_sq += v * v;
    }
    if (e.is_norm) {
      EXPECT_EQ(sum, static_cast<double>(n)) << e.name << " should be all ones";
    } else if (n >= 1000) {
      double mean = sum / n, std = std::sqrt(sum_sq / n - mean * mean);
      EXPECT_NEAR(mean, 0.0, 0.15 * InitStd(e)) << e.name;
      EXPECT_NEAR(std, InitStd(e), 0.1 * InitStd(e)) << e.name;
    }
  }

  auto gen = nlohmann::json::parse(Read(dir + "/generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], config->eos_token_ids[0]);
  EXPECT_TRUE(std::filesystem::exists(dir + "/tokenizer.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/tokenizer_config.json"));
}

TEST(PresetTest, NamesAndUnknownPreset) {
  EXPECT_THAT(PresetNames(), Contains("tiny"));
  for (const char* p :
       {"tiny-qwen2", "tiny-mistral", "qwen2.5-0.5b", "llama3.2-1b", "llama3.1-8b",
        "llama3.1-70b"}) {
    EXPECT_THAT(PresetNames(), Contains(p));
  }
  auto c = PresetConfig("gpt-5");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("\"gpt-5\""));
  MakeModelOptions o;
  o.preset = "gpt-5";
  o.out_dir = TempDir("unknown");
  EXPECT_EQ(MakeModel(o).code(), absl::StatusCode::kInvalidArgument);
}

// The parameter count of a checkpoint of `c`'s shapes.
int64_t Parameters(const ModelConfig& c) {
  int64_t params = 0;
  for (const auto& t : ExpectedTensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    params += n;
  }
  return params;
}

TEST(PresetTest, RealShapes) {
  auto q = PresetConfig("qwen2.5-0.5b");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->architecture, Architecture::kQwen2);
  EXPECT_EQ(q->hidden_size, 896);
  EXPECT_EQ(q->intermediate_size, 4864);
  EXPECT_EQ(q->num_layers, 24);
  EXPECT_EQ(q->num_heads, 14);
  EXPECT_EQ(q->num_kv_heads, 2);
  EXPECT_EQ(q->head_dim, 64);
  EXPECT_EQ(q->vocab_size, 151936);
  EXPECT_TRUE(q->tie_word_embeddings);
  EXPECT_TRUE(q->attention_bias);
  EXPECT_DOUBLE_EQ(q->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(q->rms_norm_eps, 1e-6);
  EXPECT_EQ(q->max_position_embeddings, 32768);
  EXPECT_EQ(Parameters(*q), 494032768);  // Qwen2.5-0.5B's published parameter count

  auto l1 = PresetConfig("llama3.2-1b");
  ASSERT_TRUE(l1.ok());
  EXPECT_EQ(l1->hidden_size, 2048);
  EXPECT_EQ(l1->intermediate_size, 8192);
  EXPECT_EQ(l1->num_layers, 16);
  EXPECT_EQ(l1->num_heads, 32);
  EXPECT_EQ(l1->num_kv_heads, 8);
  EXPECT_EQ(l1->head_dim, 64);
  EXPECT_EQ(l1->vocab_size, 128256);
  EXPECT_TRUE(l1->tie_word_embeddings);
  EXPECT_EQ(l1->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(l1->rope_scaling.factor, 32.0);
  EXPECT_EQ(l1->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(l1->max_position_embeddings, 131072);

  auto l8 = PresetConfig("llama3.1-8b");
  ASSERT_TRUE(l8.ok());
  EXPECT_EQ(l8->hidden_size, 4096);
  EXPECT_EQ(l8->intermediate_size, 14336);
  EXPECT_EQ(l8->num_layers, 32);
  EXPECT_EQ(l8->head_dim, 128);
  EXPECT_FALSE(l8->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(l8->rope_scaling.factor, 8.0);
  EXPECT_EQ(Parameters(*l8), 8030261248);  // Llama 3.1 8B's parameter count

  auto l70 = PresetConfig("llama3.1-70b");
  ASSERT_TRUE(l70.ok());
  EXPECT_EQ(l70->num_heads, 64);
  EXPECT_EQ(l70->num_kv_heads, 8);
  EXPECT_EQ(l70->head_dim, 128);
  EXPECT_EQ(l70->num_layers, 80);
  EXPECT_DOUBLE_EQ(l70->rope_scaling.factor, 8.0);
  EXPECT_EQ(Parameters(*l70), 70553706496);  // Llama 3.1 70B's parameter count
}

TEST(PresetTest, EveryPresetRoundTripsThroughJson) {
  for (const std::string& name : PresetNames()) {
    auto c = PresetConfig(name);
    ASSERT_TRUE(c.ok()) << name;
    auto back = ModelConfig::FromJson(c->ToJson(), name);
    ASSERT_TRUE(back.ok()) << name << ": " << back.status();
    EXPECT_EQ(back->ToJson(), c->ToJson()) << name;
    EXPECT_EQ(back->head_dim, c->head_dim) << name;
  }
  auto tiny = PresetConfig("tiny");
  EXPECT_EQ(tiny->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(tiny->rope_scaling.original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(tiny->rope_theta, 500000.0);
  auto mistral = PresetConfig("tiny-mistral");
  EXPECT_EQ(mistral->architecture, Architecture::kMistral);
  EXPECT_GT(mistral->sliding_window, 0);
}

TEST(MakeModelTest, TinyPresetsLoadBack) {
  for (const char* preset : {"tiny", "tiny-qwen2", "tiny-mistral"}) {
    SCOPED_TRACE(preset);
    std::string dir = TempDir(preset);
    ASSERT_TRUE(Make(preset, DType::kF32, 1, dir).ok()) << Make(preset, DType::kF32, 1, dir);
    EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
    ExpectLoadable(dir, *PresetConfig(preset), DType::kF32);
  }
}

TEST(MakeModelTest, Bf16) {
  std::string dir = TempDir("bf16");
  ASSERT_TRUE(Make("tiny-qwen2", DType::kBF16, 3, dir).ok());
  ExpectLoadable(dir, *PresetConfig("tiny-qwen2"), DType::kBF16);
  EXPECT_THAT(Read(dir + "/config.json"), HasSubstr("\"torch_dtype\": \"bfloat16\""));
}

TEST(MakeModelTest, ShardedMatchesUnsharded) {
  std::string one = TempDir("unsharded"), many = TempDir("sharded");
  ASSERT_TRUE(Make("tiny", DType::kF32, 7, one).ok());
  ASSERT_TRUE(Make("tiny", DType::kF32, 7, many, /*max_shard_bytes=*/100000).ok());
  EXPECT_FALSE(std::filesystem::exists(many + "/model.safetensors"));
  auto index = nlohmann::json::parse(Read(many + "/model.safetensors.index.json"));
  const auto& weight_map = index["weight_map"];
  std::set<std::string> shards;
  for (const auto& [tensor, file] : weight_map.items()) shards.insert(file.get<std::string>());
  ASSERT_GE(shards.size(), 3u);
  const std::string n = std::to_string(shards.size());
  EXPECT_EQ(*shards.begin(), "model-00001-of-0000" + n + ".safetensors");
  for (const std::string& s : shards) {
    EXPECT_LE(std::filesystem::file_size(many + "/" + s), 100000u + 4096u) << s;
  }
  ExpectLoadable(many, *PresetConfig("tiny"), DType::kF32);

  auto a = Checkpoint::Open(one);
  auto b = Checkpoint::Open(many);
  ASSERT_TRUE(a.ok() && b.ok());
  int64_t total = 0;
  for (const auto& [name, t] : (*a)->tensors()) {
    const TensorInfo* u = (*b)->tensors().at(name);
    ASSERT_EQ(t->num_bytes, u->num_bytes);
    EXPECT_EQ(std::memcmp(t->data, u->data, t->num_bytes), 0) << name;
    total += static_cast<int64_t>(t->num_bytes);
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);

  // Remaking into the same folder unsharded removes the stale shards.
  ASSERT_TRUE(Make("tiny", DType::kF32, 7, many).ok());
  EXPECT_FALSE(std::filesystem::exists(many + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(many + "/" + *shards.begin()));
}

TEST(MakeModelTest, DeterministicFromSeed) {
  std::string a = TempDir("seed_a"), b = TempDir("seed_b"), c = TempDir("seed_c");
  ASSERT_TRUE(Make("tiny", DType::kBF16, 42, a).ok());
  ASSERT_TRUE(Make("tiny", DType::kBF16, 42, b).ok());
  ASSERT_TRUE(Make("tiny", DType::kBF16, 43, c).ok());
  for (const char* f : {"/model.safetensors", "/config.json", "/generation_config.json",
                        "/tokenizer.json", "/tokenizer_config.json"}) {
    EXPECT_EQ(Read(a + f), Read(b + f)) << f;
  }
  EXPECT_NE(Read(a + "/model.safetensors"), Read(c + "/model.safetensors"));
  EXPECT_EQ(Read(a + "/config.json"), Read(c + "/config.json"));
}

TEST(MakeModelTest, BadOptions) {
  MakeModelOptions o;
  o.out_dir = "";
  EXPECT_EQ(MakeModel(o).code(), absl::StatusCode::kInvalidArgument);
  o.out_dir = TempDir("bad_shard");
  o.max_shard_bytes = 0;
  EXPECT_EQ(MakeModel(o).code(), absl::StatusCode::kInvalidArgument);
}

// The 1 GB real-shape preset, for timing by hand:
//   config_test --gtest_also_run_disabled_tests --gtest_filter='*Qwen05bBf16*'
TEST(MakeModelTest, DISABLED_Qwen05bBf16) {
  std::string dir = TempDir("qwen2.5-0.5b");
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(Make("qwen2.5-0.5b", DType::kBF16, 0, dir).ok());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("qwen2.5-0.5b bf16 written in %.2f s\n", s);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto config = ModelConfig::FromFile(dir + "/config.json");
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE((*ckpt)->CheckTensors(*config).ok());
  std::printf("total %zu bytes\n", (*ckpt)->total_bytes());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace preft::model

namespace preft::model {
namespace {

TEST(MakeModelProgressTest, ReportsEveryWeightByteOnceAndEndsAtTheTotal) {
  MakeModelOptions o;
  o.preset = "tiny";
  o.out_dir = TempDir("progress");
  o.max_shard_bytes = 200000;  // several shards: the count runs across them
  std::vector<std::pair<int64_t, int64_t>> calls;
  o.progress = [&](int64_t done, int64_t total) { calls.emplace_back(done, total); };
  ASSERT_TRUE(MakeModel(o).ok());
  ASSERT_GT(calls.size(), 2u);
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_GT(calls[i].first, calls[i - 1].first);
    EXPECT_EQ(calls[i].second, calls[0].second);
  }
  EXPECT_EQ(calls.back().first, calls.back().second);
  int64_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(o.out_dir))
    if (e.path().extension() == ".safetensors") files += std::filesystem::file_size(e.path()) > 0;
  EXPECT_GT(files, 1);
}

// fp8 KV scales come from the checkpoint (make-model --kv-scales writes what KV-quantised
// checkpoints carry: a scalar k_scale per layer, shared by its KV heads, and a v_scale per KV
// head); without them every scale is 1. A scale that is not finite and positive, or of another
// shape, is refused naming the tensor.
TEST(MakeModelTest, KvScalesComeFromTheCheckpoint) {
  const std::string plain = TempDir("kv_scales_plain"), scaled = TempDir("kv_scales");
  ASSERT_TRUE(Make("tiny-qwen2", DType::kF32, 1, plain).ok());
  MakeModelOptions o;
  o.preset = "tiny-qwen2";
  o.seed = 1;
  o.out_dir = scaled;
  o.kv_scales = true;
  o.max_shard_bytes = 64 << 10;  // shards + index, so the test can add a shard below
  ASSERT_TRUE(MakeModel(o).ok());
  auto a = Model::Load(plain);
  auto b = Model::Load(scaled);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const int64_t heads = (*b)->config().num_kv_heads;
  ASSERT_GT(heads, 1);
  for (int64_t l = 0; l < (*b)->config().num_layers; ++l) {
    EXPECT_EQ((*a)->layer(l).k_scale, std::vector<float>(heads, 1.f));
    EXPECT_EQ((*a)->layer(l).v_scale, std::vector<float>(heads, 1.f));
    const std::vector<float>& k = (*b)->layer(l).k_scale;
    const std::vector<float>& v = (*b)->layer(l).v_scale;
    ASSERT_EQ(k.size(), static_cast<size_t>(heads));
    ASSERT_EQ(v.size(), static_cast<size_t>(heads));
    EXPECT_EQ(k, std::vector<float>(heads, k[0])) << "a scalar k_scale is every head's";
    EXPECT_NE(v[0], v[1]) << "v_scale is per head";
    for (float x : k) EXPECT_TRUE(x >= 0.008f && x < 0.032f) << x;
    for (float x : v) EXPECT_TRUE(x >= 0.008f && x < 0.032f) << x;
  }

  // A shard with a bad k_scale for layer 0 takes the place of the good one in the index.
  const std::string index_path = scaled + "/model.safetensors.index.json";
  auto index = nlohmann::json::parse(Read(index_path));
  struct Bad {
    std::vector<int64_t> shape;
    std::vector<float> values;
    const char* message;
  };
  for (const Bad& bad : {Bad{{}, {0.f}, "must be finite and positive"},
                         Bad{{}, {-1.f}, "must be finite and positive"},
                         Bad{{}, {NAN}, "must be finite and positive"},
                         Bad{{3}, {1.f, 1.f, 1.f}, "expected 1 or one per KV head"}}) {
    const std::string name = "model.layers.0.self_attn.k_scale";
    {
      auto w = SafetensorsWriter::Create(scaled + "/bad.safetensors",
                                         {TensorSpec{name, DType::kF32, bad.shape}});
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE((*w)->Append(bad.values.data(), bad.values.size() * sizeof(float)).ok());
      ASSERT_TRUE((*w)->Close().ok());
    }
    index["weight_map"][name] = "bad.safetensors";
    ASSERT_TRUE(base::WriteStringToFile(index_path, index.dump()).ok());
    auto refused = Model::Load(scaled);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr(name));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr(bad.message));
  }
}

}  // namespace
}  // namespace preft::model

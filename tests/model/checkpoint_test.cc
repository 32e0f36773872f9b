#include "common/model/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/base/mapped_file.h"
#include "common/model/config.h"

namespace preft::model {
namespace {

using kernels::DType;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::string kFixture = std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama";

std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("preft_checkpoint_test_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(CheckpointTest, ReferenceFixtureHasEveryLlamaTensor) {
  auto config = ModelConfig::FromFile(kFixture + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(kFixture);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->dir(), kFixture);

  const int64_t d = config->hidden_size, v = config->vocab_size, inter = config->intermediate_size;
  const int64_t q = config->num_heads * config->head_dim;
  const int64_t kv = config->num_kv_heads * config->head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"model.embed_tokens.weight", {v, d}}, {"model.norm.weight", {d}}};
  if (!config->tie_word_embeddings) want.push_back({"lm_head.weight", {v, d}});
  for (int64_t i = 0; i < config->num_layers; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    want.push_back({p + "self_attn.q_proj.weight", {q, d}});
    want.push_back({p + "self_attn.k_proj.weight", {kv, d}});
    want.push_back({p + "self_attn.v_proj.weight", {kv, d}});
    want.push_back({p + "self_attn.o_proj.weight", {d, q}});
    want.push_back({p + "mlp.gate_proj.weight", {inter, d}});
    want.push_back({p + "mlp.up_proj.weight", {inter, d}});
    want.push_back({p + "mlp.down_proj.weight", {d, inter}});
    want.push_back({p + "input_layernorm.weight", {d}});
    want.push_back({p + "post_attention_layernorm.weight", {d}});
  }
  for (const auto& [name, shape] : want) {
    auto t = (*ckpt)->Get(name, shape);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->dtype, DType::kF32) << name;
    EXPECT_EQ((*t)->num_bytes, static_cast<size_t>((*t)->num_elements()) * 4) << name;
  }
  EXPECT_EQ((*ckpt)->tensors().size(), want.size());
  EXPECT_EQ(ExpectedTensors(*config).size(), want.size());
  EXPECT_TRUE((*ckpt)->CheckTensors(*config).ok());
  EXPECT_EQ((*ckpt)->total_bytes(), std::filesystem::file_size(kFixture + "/model.safetensors"));
}

TEST(CheckpointTest, ExpectedTensorsForQwen2AddsBiasesAndDropsTiedHead) {
  ModelConfig c;
  c.architecture = Architecture::kQwen2;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.vocab_size = 10;
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  int biases = 0;
  for (const ExpectedTensor& t : ExpectedTensors(c)) {
    EXPECT_NE(t.name, "lm_head.weight");
    EXPECT_EQ(t.name.find("o_proj.bias"), std::string::npos);
    if (t.is_bias) ++biases;
    if (t.name == "model.layers.1.self_attn.k_proj.bias") {
      EXPECT_EQ(t.shape, std::vector<int64_t>{4});
    }
  }
  EXPECT_EQ(biases, 6);
}

TEST(CheckpointTest, GetReportsMissingTensorAndWrongShape) {
  auto ckpt = Checkpoint::Open(kFixture);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto missing = (*ckpt)->Get("model.layers.9.mlp.up_proj.weight", {160, 64});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), AllOf(HasSubstr("model.layers.9.mlp.up_proj.weight"),
                                                HasSubstr("model.safetensors")));
  EXPECT_FALSE((*ckpt)->Has("model.layers.9.mlp.up_proj.weight"));
  EXPECT_TRUE((*ckpt)->Has("model.norm.weight"));

  auto wrong = (*ckpt)->Get("model.embed_tokens.weight", {301, 64});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("model.embed_tokens.weight"),
                    HasSubstr("has shape [300, 64]"), HasSubstr("expected [301, 64]")));
}

TEST(CheckpointTest, CheckTensorsNamesFirstMissingTensor) {
  auto config = ModelConfig::FromFile(kFixture + "/config.json");
  ASSERT_TRUE(config.ok());
  config->num_layers = 4;  // the fixture has 3
  auto ckpt = Checkpoint::Open(kFixture);
  ASSERT_TRUE(ckpt.ok());
  absl::Status s = (*ckpt)->CheckTensors(*config);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.3."));
  config->num_layers = 3;
  config->intermediate_size = 128;
  s = (*ckpt)->CheckTensors(*config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("mlp"), HasSubstr("expected [128, 64]")));
}

TEST(CheckpointTest, EmptyDirectoryIsNotFound) {
  std::string dir = TempDir("empty");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), AllOf(HasSubstr(dir), HasSubstr("model.safetensors")));
}

TEST(CheckpointTest, BrokenSingleFileNamesTheFile) {
  std::string dir = TempDir("broken");
  ASSERT_TRUE(base::WriteStringToFile(dir + "/model.safetensors", "abc").ok());
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr(dir + "/model.safetensors"));
}

// Two shards: a.weight in the first, b.weight in the second.
std::string WriteShardedCheckpoint(const std::string& name) {
  std::string dir = TempDir(name);
  std::vector<float> a = {1, 2, 3, 4}, b = {5, 6};
  EXPECT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors",
                               {{"a.weight", DType::kF32, {2, 2}, a.data()}})
                  .ok());
  EXPECT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors",
                               {{"b.weight", DType::kF32, {2}, b.data()}})
                  .ok());
  EXPECT_TRUE(base::WriteStringToFile(dir + "/model.safetensors.index.json", R"({
    "metadata": {"total_size": 24},
    "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                   "b.weight": "model-00002-of-00002.safetensors"}})")
                  .ok());
  return dir;
}

TEST(CheckpointTest, OpensShardedCheckpoint) {
  std::string dir = WriteShardedCheckpoint("sharded");
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->tensors().size(), 2u);
  auto b = (*ckpt)->Get("b.weight", {2});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(static_cast<const float*>((*b)->data)[1], 6.f);
  EXPECT_THAT((*b)->file, HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_GT((*ckpt)->total_bytes(), 24u);
}

TEST(CheckpointTest, IndexNamingMissingShard) {
  std::string dir = WriteShardedCheckpoint("missing_shard");
  std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), AllOf(HasSubstr("model.safetensors.index.json"),
                                             HasSubstr("model-00002-of-00002.safetensors")));
}

TEST(CheckpointTest, IndexListsTensorAbsentFromShard) {
  std::string dir = WriteShardedCheckpoint("absent");
  ASSERT_TRUE(base::WriteStringToFile(dir + "/model.safetensors.index.json", R"({
    "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                   "b.weight": "model-00001-of-00002.safetensors"}})")
                  .ok());
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(),
              AllOf(HasSubstr("'b.weight'"), HasSubstr("model-00001-of-00002.safetensors")));
}

TEST(CheckpointTest, BadIndexFiles) {
  std::string dir = WriteShardedCheckpoint("bad_index");
  const std::string index = dir + "/model.safetensors.index.json";
  for (const char* text : {"{not json", R"({"metadata": {}})", R"({"weight_map": {}})",
                           R"({"weight_map": {"a.weight": 3}})",
                           R"({"weight_map": {"a.weight": "../../etc/passwd"}})"}) {
    ASSERT_TRUE(base::WriteStringToFile(index, text).ok());
    auto ckpt = Checkpoint::Open(dir);
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors.index.json")) << text;
  }
}

TEST(CheckpointTest, CorruptShardNamesShardAndIndex) {
  std::string dir = WriteShardedCheckpoint("corrupt_shard");
  ASSERT_TRUE(base::WriteStringToFile(dir + "/model-00001-of-00002.safetensors",
                                      std::string("\x10\0\0\0\0\0\0\0{\"x\":", 13))
                  .ok());
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), AllOf(HasSubstr("model-00001-of-00002.safetensors"),
                                             HasSubstr("model.safetensors.index.json")));
}

}  // namespace
}  // namespace preft::model

#include "common/model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/base/mapped_file.h"
#include "nlohmann/json.hpp"

namespace preft::model {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// A minimal valid Llama config; tests edit one field at a time.
Json LlamaJson() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"})");
}

absl::StatusOr<ModelConfig> Parse(const Json& j) {
  return ModelConfig::FromJson(j.dump(), "some/dir/config.json");
}

void ExpectInvalid(const Json& j, const std::string& fact) {
  auto c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << j.dump();
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("some/dir/config.json"), HasSubstr(fact)))
      << j.dump();
}

TEST(ConfigTest, ReadsReferenceFixture) {
  auto c =
      ModelConfig::FromFile(std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kLlama);
  EXPECT_EQ(c->architecture_name, "LlamaForCausalLM");
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 160);
  EXPECT_EQ(c->num_layers, 3);
  EXPECT_EQ(c->num_heads, 4);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->vocab_size, 300);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 64);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->bos_token_id, 298);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(299));
  EXPECT_EQ(c->torch_dtype, kernels::DType::kF32);
}

TEST(ConfigTest, Llama31RopeScalingWithOldTypeKey) {
  Json j = LlamaJson();
  j["rope_scaling"] = {{"type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  j["eos_token_id"] = {128001, 128008, 128009};
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->torch_dtype, kernels::DType::kBF16);
}

TEST(ConfigTest, LinearAndDefaultRopeScaling) {
  Json j = LlamaJson();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(Parse(j)->rope_scaling.type, RopeScaling::Type::kNone);
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(Parse(j)->rope_scaling.type, RopeScaling::Type::kNone);
}

TEST(ConfigTest, RefusesOtherRopeTypes) {
  for (const char* type : {"yarn", "dynamic", "longrope"}) {
    Json j = LlamaJson();
    j["rope_scaling"] = {{"rope_type", type}, {"factor", 4.0}};
    ExpectInvalid(j, std::string("unsupported rope_scaling type \"") + type + "\"");
  }
  Json j = LlamaJson();
  j["rope_scaling"] = {{"factor", 4.0}};
  ExpectInvalid(j, "rope_type");
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  ExpectInvalid(j, "original_max_position_embeddings");
  j["rope_scaling"] = {{"rope_type", "linear"}};
  ExpectInvalid(j, "factor");
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 4.0},
                       {"high_freq_factor", 1.0},
                       {"original_max_position_embeddings", 64}};
  ExpectInvalid(j, "high_freq_factor");
}

TEST(ConfigTest, Qwen2HasBiasAndTiedEmbeddings) {
  // Qwen2.5-0.5B-Instruct's config.json (abridged).
  auto c = ModelConfig::FromJson(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 151936})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kQwen2);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window is false
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645));
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
}

TEST(ConfigTest, MistralRecordsSlidingWindow) {
  Json j = LlamaJson();
  j["architectures"] = {"MistralForCausalLM"};
  j["model_type"] = "mistral";
  j["sliding_window"] = 4096;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kMistral);
  EXPECT_EQ(c->sliding_window, 4096);
  j["sliding_window"] = nullptr;
  EXPECT_EQ(Parse(j)->sliding_window, 0);
}

TEST(ConfigTest, HeadDimFromConfigOrDerived) {
  Json j = LlamaJson();
  EXPECT_EQ(Parse(j)->head_dim, 16);
  j["head_dim"] = 32;  // Gemma/Llama-3.2 style: head_dim * heads != hidden
  EXPECT_EQ(Parse(j)->head_dim, 32);
  j.erase("head_dim");
  j["hidden_size"] = 66;
  ExpectInvalid(j, "not a multiple of num_attention_heads");
}

TEST(ConfigTest, DefaultsForOptionalFields) {
  Json j = LlamaJson();
  for (const char* key :
       {"num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "bos_token_id", "eos_token_id", "torch_dtype", "model_type"}) {
    j.erase(key);
  }
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->torch_dtype, kernels::DType::kF32);
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
}

TEST(ConfigTest, TorchDtypes) {
  Json j = LlamaJson();
  j["torch_dtype"] = "float16";
  EXPECT_EQ(Parse(j)->torch_dtype, kernels::DType::kF16);
  j["torch_dtype"] = "float32";
  EXPECT_EQ(Parse(j)->torch_dtype, kernels::DType::kF32);
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";  // newer transformers
  EXPECT_EQ(Parse(j)->torch_dtype, kernels::DType::kBF16);
  j["dtype"] = "int8";
  ExpectInvalid(j, "int8");
}

TEST(ConfigTest, UnknownArchitectureIsNamed) {
  Json j = LlamaJson();
  j["architectures"] = {"GPT2LMHeadModel"};
  ExpectInvalid(j, "unsupported architecture \"GPT2LMHeadModel\"");
  j.erase("architectures");
  j["model_type"] = "gemma";
  ExpectInvalid(j, "\"gemma\"");
  j.erase("model_type");
  ExpectInvalid(j, "missing required field \"architectures\"");
  j["architectures"] = Json::array();
  ExpectInvalid(j, "architectures");
}

TEST(ConfigTest, ModelTypeAloneSelectsArchitecture) {
  Json j = LlamaJson();
  j.erase("architectures");
  j["model_type"] = "qwen2";
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kQwen2);
  EXPECT_EQ(c->architecture_name, "Qwen2ForCausalLM");
}

TEST(ConfigTest, MissingFieldsAreNamed) {
  for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size"}) {
    Json j = LlamaJson();
    j.erase(key);
    ExpectInvalid(j, std::string("missing required field \"") + key + "\"");
  }
}

TEST(ConfigTest, BadValuesAreNamed) {
  Json j = LlamaJson();
  j["hidden_size"] = 0;
  ExpectInvalid(j, "\"hidden_size\" must be in [1,");
  j = LlamaJson();
  j["num_hidden_layers"] = -3;
  ExpectInvalid(j, "\"num_hidden_layers\"");
  j = LlamaJson();
  j["vocab_size"] = "300";
  ExpectInvalid(j, "\"vocab_size\" must be an integer, got \"300\"");
  j = LlamaJson();
  j["intermediate_size"] = 160.5;
  ExpectInvalid(j, "\"intermediate_size\" must be an integer");
  j = LlamaJson();
  j["vocab_size"] = 18446744073709551615ull;
  ExpectInvalid(j, "too large");
  j = LlamaJson();
  j["num_key_value_heads"] = 3;
  ExpectInvalid(j, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)");
  j = LlamaJson();
  j["rms_norm_eps"] = -1;
  ExpectInvalid(j, "rms_norm_eps");
  j = LlamaJson();
  j["eos_token_id"] = {2, "x"};
  ExpectInvalid(j, "eos_token_id");
  j = LlamaJson();
  j["bos_token_id"] = -5;
  ExpectInvalid(j, "bos_token_id");
  j = LlamaJson();
  j["tie_word_embeddings"] = 1;
  ExpectInvalid(j, "tie_word_embeddings");
  j = LlamaJson();
  j["hidden_act"] = "gelu";
  ExpectInvalid(j, "hidden_act");
  j = LlamaJson();
  j["mlp_bias"] = true;
  ExpectInvalid(j, "mlp_bias");
}

TEST(ConfigTest, NotJsonOrNotObject) {
  auto c = ModelConfig::FromJson("{\"hidden_size\": ", "x/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("x/config.json"), HasSubstr("not valid JSON")));
  c = ModelConfig::FromJson("[1, 2]", "x/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("JSON object"));
  c = ModelConfig::FromJson(std::string(100000, '['), "x/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, FromFileNamesThePath) {
  auto dir =
      std::filesystem::temp_directory_path() / ("preft_config_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "config.json").string();
  auto missing = ModelConfig::FromFile(path + ".nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("config.json.nope"));
  ASSERT_TRUE(base::WriteStringToFile(path, R"({"architectures": ["LlamaForCausalLM"]})").ok());
  auto bad = ModelConfig::FromFile(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), AllOf(HasSubstr(path), HasSubstr("hidden_size")));
}

TEST(ConfigTest, ToJsonRoundTrips) {
  Json j = LlamaJson();
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 32.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  j["eos_token_id"] = {7, 8};
  j["attention_bias"] = true;
  j["head_dim"] = 32;
  auto a = Parse(j);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = ModelConfig::FromJson(a->ToJson());
  ASSERT_TRUE(b.ok()) << b.status() << a->ToJson();
  EXPECT_EQ(b->ToJson(), a->ToJson());
  EXPECT_EQ(b->head_dim, 32);
  EXPECT_TRUE(b->attention_bias);
  EXPECT_THAT(b->eos_token_ids, ElementsAre(7, 8));
  EXPECT_EQ(b->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(b->torch_dtype, kernels::DType::kBF16);
}

}  // namespace
}  // namespace preft::model

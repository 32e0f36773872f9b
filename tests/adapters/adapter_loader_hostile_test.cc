// LoadAdapter on broken, mismatched and unsupported folders: each case must fail with the
// right code and a message that says what is wrong, never crash.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "tests/adapters/adapter_test_util.h"

namespace preft::adapters {
namespace {

using absl::StatusCode;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace ::preft::adapters::testing;  // NOLINT: test helpers

void ExpectError(const std::string& dir, StatusCode code, const std::string& substring,
                 const model::ModelConfig& base = TinyConfig(), const LoadOptions& options = {}) {
  auto a = LoadAdapter(dir, base, options);
  ASSERT_FALSE(a.ok()) << dir << " loaded";
  EXPECT_EQ(a.status().code(), code) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr(substring));
}

void EditLora(const std::string& name, const std::function<void(OrderedJson&)>& edit,
              StatusCode code, const std::string& substring) {
  SCOPED_TRACE(name);
  const std::string dir = CopyFixture("lora", name);
  EditConfig(dir, edit);
  ExpectError(dir, code, substring);
}

void EditDireft(const std::string& name, const std::function<void(OrderedJson&)>& edit,
                StatusCode code, const std::string& substring) {
  SCOPED_TRACE(name);
  const std::string dir = CopyFixture("direft", name);
  EditConfig(dir, edit);
  ExpectError(dir, code, substring);
}

// Rewrites the fixture's LoRA tensors through `edit`.
std::string EditLoraTensors(const std::string& name,
                            const std::function<void(std::vector<Tensor>&)>& edit) {
  const std::string dir = CopyFixture("lora", name);
  std::vector<Tensor> t = ReadTensors(dir);
  edit(t);
  WriteTensors(dir, t);
  return dir;
}

Tensor* Find(std::vector<Tensor>& tensors, const std::string& suffix) {
  for (Tensor& t : tensors) {
    if (t.name.size() >= suffix.size() &&
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return &t;
    }
  }
  ADD_FAILURE() << "no tensor ending in " << suffix;
  static Tensor dummy;
  return &dummy;
}

TEST(AdapterLoaderHostileTest, MissingFiles) {
  ExpectError("/nonexistent/adapter", StatusCode::kNotFound, "adapter folder not found");
  const std::string dir = TempDir("missing");
  ExpectError(dir, StatusCode::kNotFound, "adapter_config.json");
  WriteText(dir + "/adapter_config.json",
            ReadText(FixtureAdapter("lora") + "/adapter_config.json"));
  ExpectError(dir, StatusCode::kNotFound, "adapter_model.safetensors");
  WriteText(dir + "/adapter_model.bin", "PK\x03\x04 pickle");
  ExpectError(dir, StatusCode::kUnimplemented, "convert to safetensors");
}

TEST(AdapterLoaderHostileTest, CorruptOrTruncatedSafetensors) {
  const std::string dir = CopyFixture("lora", "truncated");
  const std::string path = dir + "/adapter_model.safetensors";
  std::filesystem::resize_file(path, 4000);
  ExpectError(dir, StatusCode::kDataLoss, "truncated");
  std::filesystem::resize_file(path, 3);
  ExpectError(dir, StatusCode::kDataLoss, "adapter_model.safetensors");

  std::string garbage(8, '\0');
  garbage[0] = 5;
  garbage += "{{{{{";
  WriteText(path, garbage);
  ExpectError(dir, StatusCode::kInvalidArgument, "not valid JSON");
}

TEST(AdapterLoaderHostileTest, MalformedJson) {
  const std::string dir = CopyFixture("lora", "malformed");
  for (const char* text : {"", "{", "{\"peft_type\": \"LORA\",}", "[1, 2]", "null",
                           "{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]"
                           "]]]]]]]]]]]]]]]]}"}) {
    SCOPED_TRACE(text);
    WriteText(dir + "/adapter_config.json", text);
    auto a = LoadAdapter(dir, TinyConfig());
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr("adapter_config.json"));
  }
  WriteText(dir + "/adapter_config.json", "{\"r\": 8");
  ExpectError(dir, StatusCode::kInvalidArgument, "not valid JSON");
  WriteText(dir + "/adapter_config.json", "[]");
  ExpectError(dir, StatusCode::kInvalidArgument, "JSON object");
}

TEST(AdapterLoaderHostileTest, WrongJsonTypes) {
  const auto invalid = StatusCode::kInvalidArgument;
  EditLora(
      "r_string", [](OrderedJson& j) { j["r"] = "8"; }, invalid, "\"r\" must be an integer");
  EditLora(
      "r_float", [](OrderedJson& j) { j["r"] = 8.5; }, invalid, "\"r\" must be an integer");
  EditLora(
      "r_huge", [](OrderedJson& j) { j["r"] = uint64_t{1} << 40; }, invalid, "\"r\"");
  EditLora(
      "alpha_string", [](OrderedJson& j) { j["lora_alpha"] = "16"; }, invalid,
      "\"lora_alpha\" must be a finite number");
  EditLora(
      "rslora_string", [](OrderedJson& j) { j["use_rslora"] = "yes"; }, invalid,
      "\"use_rslora\" must be true or false");
  EditLora(
      "targets_number", [](OrderedJson& j) { j["target_modules"] = 5; }, invalid,
      "\"target_modules\" must be a list");
  EditLora(
      "targets_mixed",
      [](OrderedJson& j) {
        j["target_modules"] = {"q_proj", 1};
      },
      invalid, "entries must be strings");
  EditLora(
      "targets_bad_regex", [](OrderedJson& j) { j["target_modules"] = "(q_proj"; }, invalid,
      "does not compile");
  EditLora(
      "rank_pattern_list",
      [](OrderedJson& j) {
        j["rank_pattern"] = {1, 2};
      },
      invalid, "\"rank_pattern\" must be an object");
  EditLora(
      "rank_pattern_value",
      [](OrderedJson& j) {
        j["rank_pattern"] = {{"q_proj", "4"}};
      },
      invalid, "rank_pattern[\"q_proj\"]");
  EditLora(
      "alpha_pattern_value",
      [](OrderedJson& j) {
        j["alpha_pattern"] = {{"q_proj", {}}};
      },
      invalid, "alpha_pattern[\"q_proj\"]");
  EditLora(
      "peft_type_number", [](OrderedJson& j) { j["peft_type"] = 3; }, invalid,
      "\"peft_type\" must be a string");
  EditLora(
      "peft_type_missing", [](OrderedJson& j) { j.erase("peft_type"); }, invalid,
      "missing \"peft_type\"");
  EditLora(
      "positions_type", [](OrderedJson& j) { j["preft_positions"] = true; }, invalid,
      "preft_positions");
  EditLora(
      "modules_to_save_type", [](OrderedJson& j) { j["modules_to_save"] = "lm_head"; }, invalid,
      "modules_to_save");
  EditDireft(
      "layers_object",
      [](OrderedJson& j) {
        j["layers"] = {{"a", 1}};
      },
      invalid, "\"layers\" must be a list");
  EditDireft(
      "layers_strings", [](OrderedJson& j) { j["layers"] = {"0"}; }, invalid,
      "\"layers\" entries must be integers");
  EditDireft(
      "component_number", [](OrderedJson& j) { j["component"] = 1; }, invalid,
      "\"component\" must be a string");
  EditDireft(
      "r_missing", [](OrderedJson& j) { j.erase("r"); }, invalid, "missing required field \"r\"");
}

TEST(AdapterLoaderHostileTest, AdapterForAnotherBase) {
  model::ModelConfig wide = TinyConfig();
  wide.hidden_size = 128;
  wide.head_dim = 32;
  for (model::AdapterKind kind : {model::AdapterKind::kLora, model::AdapterKind::kDireft}) {
    SCOPED_TRACE(model::AdapterKindName(kind));
    const std::string dir = TempDir(std::string("wide_") + model::AdapterKindName(kind));
    RandomAdapterSpec spec;
    spec.kind = kind;
    ASSERT_TRUE(WriteRandomAdapter(wide, spec, dir).ok());
    auto a = LoadAdapter(dir, TinyConfig());
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(),
                AllOf(HasSubstr("adapter_model.safetensors"), HasSubstr("layers.0."),
                      HasSubstr("has shape [8, 128], expected [8, 64]")));
  }
  // A declared hidden size that is not the base's.
  EditDireft(
      "hidden_size", [](OrderedJson& j) { j["hidden_size"] = 4096; }, StatusCode::kInvalidArgument,
      "\"hidden_size\" is 4096 but the base model's");
  // More layers than the base has.
  model::ModelConfig shallow = TinyConfig();
  shallow.num_layers = 2;
  ExpectError(FixtureAdapter("lora"), StatusCode::kInvalidArgument,
              "layer 2 is out of range: the base model has 2 layers", shallow);
  ExpectError(FixtureAdapter("direft"), StatusCode::kInvalidArgument,
              "\"layers\" names layer 2, out of range", shallow);
}

TEST(AdapterLoaderHostileTest, Ranks) {
  const auto invalid = StatusCode::kInvalidArgument;
  EditLora(
      "r_zero", [](OrderedJson& j) { j["r"] = 0; }, invalid, "\"r\" must be >= 1, got 0");
  EditDireft(
      "direft_r_zero", [](OrderedJson& j) { j["r"] = 0; }, invalid, "\"r\" must be >= 1, got 0");
  EditLora(
      "rank_pattern_zero",
      [](OrderedJson& j) {
        j["rank_pattern"] = {{"q_proj", 0}};
      },
      invalid, "must be a rank >= 1");
  EditLora(
      "r_mismatch", [](OrderedJson& j) { j["r"] = 4; }, invalid,
      "has rank 8 but adapter_config.json gives module model.layers.0.self_attn.q_proj r = 4");
  EditLora(
      "rank_pattern_mismatch",
      [](OrderedJson& j) {
        j["rank_pattern"] = {{"v_proj", 2}};
      },
      invalid, "r = 2 (after rank_pattern)");
  EditDireft(
      "direft_r_mismatch", [](OrderedJson& j) { j["r"] = 2; }, invalid,
      "has rank 4 but adapter_config.json says r = 2");
  LoadOptions small;
  small.max_rank = 4;
  ExpectError(FixtureAdapter("lora"), invalid,
              "rank 8 of module model.layers.0.self_attn.q_proj "
              "exceeds the maximum rank 4",
              TinyConfig(), small);
  small.max_rank = 3;
  ExpectError(FixtureAdapter("direft"), invalid, "rank 4 exceeds the maximum rank 3", TinyConfig(),
              small);
}

TEST(AdapterLoaderHostileTest, NonFiniteWeights) {
  std::string dir = EditLoraTensors("nan", [](std::vector<Tensor>& t) {
    Find(t, "layers.1.mlp.up_proj.lora_B.weight")->values[8 * 3 + 5] = std::nanf("");
  });
  ExpectError(dir, StatusCode::kInvalidArgument,
              "tensor 'base_model.model.model.layers.1.mlp.up_proj.lora_B.weight' holds NaN at "
              "element [3, 5]");
  dir = EditLoraTensors("inf", [](std::vector<Tensor>& t) {
    Find(t, "layers.0.self_attn.q_proj.lora_A.weight")->values[0] =
        std::numeric_limits<float>::infinity();
  });
  ExpectError(dir, StatusCode::kInvalidArgument, "holds Inf at element [0, 0]");

  const std::string d = CopyFixture("direft", "direft_nan");
  std::vector<Tensor> t = ReadTensors(d);
  Find(t, "layers.2.direft.learned_source.bias")->values[1] = std::nanf("");
  WriteTensors(d, t);
  ExpectError(d, StatusCode::kInvalidArgument, "'layers.2.direft.learned_source.bias' holds NaN");

  // Finite in f32 but not in f16.
  dir = EditLoraTensors("f16_overflow", [](std::vector<Tensor>& t) {
    Find(t, "layers.0.self_attn.q_proj.lora_A.weight")->values[0] = 1e6f;
  });
  LoadOptions f16;
  f16.dtype = kernels::DType::kF16;
  ExpectError(dir, StatusCode::kInvalidArgument, "overflows f16", TinyConfig(), f16);
}

// A file already in the compute dtype is copied as bits after a word-at-a-time scan for
// non-finite values: the scan must find them in bf16 and f16 too, wherever they sit, and the
// copy (transposed for B) must equal the element-by-element conversion.
TEST(AdapterLoaderHostileTest, HalfPrecisionFilesCopyAsBitsAndStillRefuseNonFinite) {
  for (const kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kF16}) {
    SCOPED_TRACE(kernels::DTypeName(dtype));
    auto to_dtype = [dtype](std::vector<Tensor>& t) {
      for (Tensor& x : t) x.dtype = dtype;
    };
    LoadOptions same;
    same.dtype = dtype;
    const std::string clean = EditLoraTensors(std::string("clean_") + kernels::DTypeName(dtype), to_dtype);
    auto bits = LoadAdapter(clean, TinyConfig(), same);
    auto converted = LoadAdapter(clean, TinyConfig());  // element by element, to f32
    ASSERT_TRUE(bits.ok() && converted.ok()) << bits.status() << converted.status();
    int64_t compared = 0;
    for (int64_t l = 0; l < TinyConfig().num_layers; ++l) {
      for (int p = 0; p < model::kNumProjections; ++p) {
        const model::LowRank& a = (*bits)->lora(l, static_cast<model::Projection>(p));
        const model::LowRank& b = (*converted)->lora(l, static_cast<model::Projection>(p));
        ASSERT_EQ(a.empty(), b.empty());
        if (a.empty()) continue;
        for (const auto& [x, y] : {std::pair{a.shrink, b.shrink}, std::pair{a.expand, b.expand}}) {
          ASSERT_EQ(x.rows, y.rows);
          ASSERT_EQ(x.cols, y.cols);
          for (int64_t i = 0; i < x.rows * x.cols; ++i, ++compared) {
            ASSERT_EQ(kernels::LoadAsF32(x.data, dtype, i), kernels::LoadAsF32(y.data, y.dtype, i))
                << "layer " << l << " projection " << p << " element " << i;
          }
        }
      }
    }
    EXPECT_GT(compared, 0);

    struct Poke {
      const char* tensor;
      int64_t index;
      float value;
      const char* expect;
    };
    const Poke pokes[] = {
        {"layers.1.mlp.up_proj.lora_B.weight", 8 * 3 + 5, std::nanf(""), "holds NaN at element [3, 5]"},
        {"layers.0.self_attn.q_proj.lora_A.weight", 0, std::numeric_limits<float>::infinity(),
         "holds Inf at element [0, 0]"},
        {"layers.0.self_attn.q_proj.lora_A.weight", -1, -std::numeric_limits<float>::infinity(),
         "holds Inf at element"},
    };
    for (const Poke& poke : pokes) {
      const std::string dir =
          EditLoraTensors(std::string("poke_") + kernels::DTypeName(dtype), [&](std::vector<Tensor>& t) {
            to_dtype(t);
            Tensor* x = Find(t, poke.tensor);
            const int64_t at = poke.index >= 0 ? poke.index
                                               : static_cast<int64_t>(x->values.size()) - 1;
            x->values[at] = poke.value;
          });
      ExpectError(dir, StatusCode::kInvalidArgument, poke.expect, TinyConfig(), same);
    }
  }
}

TEST(AdapterLoaderHostileTest, UnsupportedLoraFeatures) {
  const auto unimplemented = StatusCode::kUnimplemented;
  EditLora(
      "dora", [](OrderedJson& j) { j["use_dora"] = true; }, unimplemented, "DoRA");
  EditLora(
      "modules_to_save", [](OrderedJson& j) { j["modules_to_save"] = {"lm_head"}; }, unimplemented,
      "\"modules_to_save\" [\"lm_head\"] is not supported");
  EditLora(
      "bias_all", [](OrderedJson& j) { j["bias"] = "all"; }, unimplemented,
      "\"bias\": \"all\" is not supported");
  EditLora(
      "lora_bias", [](OrderedJson& j) { j["lora_bias"] = true; }, unimplemented, "lora_bias");
  EditLora(
      "embed_target", [](OrderedJson& j) { j["target_modules"].push_back("embed_tokens"); },
      unimplemented, "embed_tokens");
  EditLora(
      "lm_head_target", [](OrderedJson& j) { j["target_modules"] = "lm_head|.*q_proj"; },
      unimplemented, "lm_head");
  EditLora(
      "unknown_target", [](OrderedJson& j) { j["target_modules"].push_back("fc1"); }, unimplemented,
      "unknown module \"fc1\"");
  EditLora(
      "loha", [](OrderedJson& j) { j["peft_type"] = "LOHA"; }, unimplemented,
      "peft_type \"LOHA\" is not supported");
  EditLora(
      "lora_prompt_positions", [](OrderedJson& j) { j["prompt_positions"] = "f3"; }, unimplemented,
      "prompt_positions");
  EditLora(
      "layer_replication",
      [](OrderedJson& j) {
        j["layer_replication"] = {{0, 2}};
      },
      unimplemented, "layer_replication");

  auto extra = [](const std::string& name, std::vector<int64_t> shape) {
    return [name, shape](std::vector<Tensor>& t) { t.push_back(Ramp(name, shape, 0)); };
  };
  ExpectError(
      EditLoraTensors("dora_tensor", extra("base_model.model.model.layers.0.self_attn.q_proj."
                                           "lora_magnitude_vector.default.weight",
                                           {64})),
      unimplemented, "DoRA");
  ExpectError(
      EditLoraTensors("embedding_tensor",
                      extra("base_model.model.model.embed_tokens.lora_embedding_A", {8, 300})),
      unimplemented, "embedding LoRA");
  ExpectError(
      EditLoraTensors("lm_head_tensor", extra("base_model.model.lm_head.lora_A.weight", {8, 64})),
      unimplemented, "lm_head");
  ExpectError(EditLoraTensors("saved_module", extra("base_model.model.score.modules_to_save."
                                                    "default.weight",
                                                    {2, 64})),
              unimplemented, "modules_to_save");
  ExpectError(EditLoraTensors("bias_tensor",
                              extra("base_model.model.model.layers.0.self_attn.q_proj.bias", {64})),
              unimplemented, "bias");
  ExpectError(
      EditLoraTensors("unknown_module",
                      extra("base_model.model.model.layers.0.mlp.fc1.lora_A.weight", {8, 64})),
      unimplemented, "unknown module \"mlp.fc1\"");
  ExpectError(EditLoraTensors("stray", extra("something.else", {1})), StatusCode::kInvalidArgument,
              "'something.else': not a LoRA tensor");
}

TEST(AdapterLoaderHostileTest, LoraTensorsDisagreeWithConfig) {
  const auto invalid = StatusCode::kInvalidArgument;
  std::string dir = EditLoraTensors("a_without_b", [](std::vector<Tensor>& t) {
    t.erase(t.begin() + (Find(t, "layers.2.mlp.gate_proj.lora_B.weight") - t.data()));
  });
  ExpectError(
      dir, invalid,
      "'base_model.model.model.layers.2.mlp.gate_proj.lora_A.weight' has no lora_B partner");
  dir = EditLoraTensors("b_without_a", [](std::vector<Tensor>& t) {
    t.erase(t.begin() + (Find(t, "layers.0.self_attn.o_proj.lora_A.weight") - t.data()));
  });
  ExpectError(dir, invalid, "o_proj.lora_B.weight' has no lora_A partner");
  dir = EditLoraTensors("module_missing", [](std::vector<Tensor>& t) {
    t.erase(t.begin() + (Find(t, "layers.1.mlp.up_proj.lora_A.weight") - t.data()));
    t.erase(t.begin() + (Find(t, "layers.1.mlp.up_proj.lora_B.weight") - t.data()));
  });
  ExpectError(dir, invalid, "no lora_A / lora_B tensors for module model.layers.1.mlp.up_proj");
  dir = EditLoraTensors("layer_out_of_range", [](std::vector<Tensor>& t) {
    t.push_back(Ramp("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", {8, 64}, 0));
  });
  ExpectError(dir, invalid, "layer 7 is out of range: the base model has 3 layers");
  dir = EditLoraTensors("wrong_b_shape", [](std::vector<Tensor>& t) {
    Find(t, "layers.0.self_attn.k_proj.lora_B.weight")->shape = {64, 4};  // same byte count
  });
  ExpectError(dir, invalid, "has shape [64, 4], expected [32, 8]");
  dir = CopyFixture("lora_rs", "untargeted");
  EditConfig(dir, [](OrderedJson& j) { j["target_modules"] = {"q_proj"}; });
  ExpectError(dir, invalid, "v_proj, which adapter_config.json's target_modules does not select");
  dir = CopyFixture("lora", "layers_to_transform_out_of_range");
  EditConfig(dir, [](OrderedJson& j) { j["layers_to_transform"] = {0, 9}; });
  ExpectError(dir, invalid, "\"layers_to_transform\" names layer 9, out of range");
  dir = CopyFixture("lora", "empty");
  WriteTensors(dir, {});
  EditConfig(dir, [](OrderedJson& j) { j.erase("target_modules"); });
  ExpectError(dir, invalid, "holds no LoRA tensors");
}

TEST(AdapterLoaderHostileTest, UnsupportedOrBadDireft) {
  const auto invalid = StatusCode::kInvalidArgument;
  EditDireft(
      "component", [](OrderedJson& j) { j["component"] = "block_input"; },
      StatusCode::kUnimplemented, "\"component\": \"block_input\" is not supported");
  EditDireft(
      "act_fn", [](OrderedJson& j) { j["act_fn"] = "relu"; }, StatusCode::kUnimplemented,
      "\"act_fn\": \"relu\" is not supported");
  EditDireft(
      "prompt_positions", [](OrderedJson& j) { j["prompt_positions"] = "first3"; }, invalid,
      "\"prompt_positions\": \"first3\" is not");
  EditDireft(
      "preft_positions", [](OrderedJson& j) { j["preft_positions"] = "sometimes"; }, invalid,
      "\"preft_positions\" must be \"prompt\" or \"all\"");
  EditDireft(
      "layers_empty", [](OrderedJson& j) { j["layers"] = OrderedJson::array(); }, invalid,
      "\"layers\" is empty");
  EditDireft(
      "layers_twice",
      [](OrderedJson& j) {
        j["layers"] = {0, 0, 1, 2};
      },
      invalid, "lists layer 0 twice");
  EditDireft(
      "layers_fewer",
      [](OrderedJson& j) {
        j["layers"] = {0, 1};
      },
      invalid, "'layers.2.direft.learned_source.bias' is for layer 2, which adapter_config.json's");

  const std::string dir = CopyFixture("direft", "direft_missing");
  std::vector<Tensor> t = ReadTensors(dir);
  t.erase(t.begin() + (Find(t, "layers.1.direft.proj_layer.weight") - t.data()));
  WriteTensors(dir, t);
  ExpectError(dir, invalid, "missing tensor 'layers.1.direft.proj_layer.weight' for layer 1");

  t = ReadTensors(FixtureAdapter("direft"));
  t.push_back(Ramp("layers.0.direft.rotate_layer.weight", {4, 64}, 0));
  WriteTensors(dir, t);
  ExpectError(dir, invalid, "unexpected tensor 'layers.0.direft.rotate_layer.weight'");
}

// A confined load (every client-named folder) reads nothing through a symbolic link, even one
// that appeared after the path was checked: a folder swapped for a link, or a file that is one.
// An unconfined load (local use) follows them, as a Hugging Face cache needs.
TEST(AdapterLoaderHostileTest, AConfinedLoadFollowsNoLinkAndStaysUnderTheRoot) {
  namespace fs = std::filesystem;
  const fs::path root = fs::canonical(TempDir("confined_root"));
  const std::string elsewhere = CopyFixture("lora", "confined_elsewhere");
  fs::copy(elsewhere, root / "real");
  LoadOptions confined;
  confined.confine_to = root.string();
  ASSERT_TRUE(LoadAdapter((root / "real").string(), TinyConfig(), confined).ok());

  // The folder, checked while real, is now a link to a folder outside the root.
  fs::create_directory_symlink(elsewhere, root / "swapped");
  ExpectError((root / "swapped").string(), StatusCode::kInvalidArgument, "symbolic link",
              TinyConfig(), confined);
  EXPECT_TRUE(LoadAdapter((root / "swapped").string(), TinyConfig()).ok());

  // A weights file that links to another adapter's weights, inside the root.
  fs::create_directories(root / "linked");
  fs::copy(root / "real" / "adapter_config.json", root / "linked");
  fs::create_symlink(root / "real" / "adapter_model.safetensors",
                     root / "linked" / "adapter_model.safetensors");
  ExpectError((root / "linked").string(), StatusCode::kInvalidArgument,
              "linked/adapter_model.safetensors: a symbolic link", TinyConfig(), confined);
  EXPECT_TRUE(LoadAdapter((root / "linked").string(), TinyConfig()).ok());

  ExpectError(elsewhere, StatusCode::kInvalidArgument, "outside the adapter root", TinyConfig(),
              confined);
  ExpectError((root / "real" / ".." / ".." / fs::path(elsewhere).filename()).string(),
              StatusCode::kInvalidArgument, "outside", TinyConfig(), confined);
  ExpectError((root / "missing").string(), StatusCode::kNotFound, "adapter folder not found",
              TinyConfig(), confined);
}

}  // namespace
}  // namespace preft::adapters

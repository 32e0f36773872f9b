#include "common/adapters/make_adapter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/model/make_model.h"
#include "tests/adapters/adapter_test_util.h"

namespace preft::adapters {
namespace {

using kernels::DType;
using model::AdapterKind;
using model::AdapterPositions;
using model::Projection;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace ::preft::adapters::testing;  // NOLINT: test helpers

std::map<std::string, std::vector<int64_t>> Shapes(const std::vector<Tensor>& tensors) {
  std::map<std::string, std::vector<int64_t>> m;
  for (const Tensor& t : tensors) m[t.name] = t.shape;
  return m;
}

const Tensor& Named(const std::vector<Tensor>& tensors, const std::string& name) {
  for (const Tensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  static Tensor none;
  return none;
}

// The writer produces exactly the fixture's tensor names and shapes, and its config keys.
TEST(MakeAdapterTest, MatchesTheFixtureFormats) {
  const model::ModelConfig base = TinyConfig();
  const std::string lora = TempDir("format_lora");
  ASSERT_TRUE(WriteRandomAdapter(base, {}, lora).ok());
  EXPECT_EQ(Shapes(ReadTensors(lora)), Shapes(ReadTensors(FixtureAdapter("lora"))));
  OrderedJson got = ReadConfig(lora);
  const OrderedJson fixture = ReadConfig(FixtureAdapter("lora"));
  for (const auto& [key, value] : fixture.items()) {
    EXPECT_TRUE(got.contains(key)) << key;
    if (key != "base_model_name_or_path") {
      EXPECT_EQ(got[key], value) << key;
    }
  }

  RandomAdapterSpec spec;
  spec.kind = AdapterKind::kDireft;
  spec.rank = 4;
  const std::string direft = TempDir("format_direft");
  ASSERT_TRUE(WriteRandomAdapter(base, spec, direft).ok());
  EXPECT_EQ(Shapes(ReadTensors(direft)), Shapes(ReadTensors(FixtureAdapter("direft"))));
  EXPECT_EQ(ReadConfig(direft), ReadConfig(FixtureAdapter("direft")));
}

TEST(MakeAdapterTest, LoraRoundTrips) {
  RandomAdapterSpec spec;
  spec.rank = 4;
  spec.alpha = 8;
  spec.use_rslora = true;
  spec.targets = {Projection::kDown, Projection::kQ};
  spec.layers = {2, 0};
  spec.preft_positions = AdapterPositions::kPrompt;
  spec.dtype = DType::kBF16;
  spec.seed = 7;
  const std::string dir = TempDir("lora_round_trip");
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, dir).ok());

  const OrderedJson c = ReadConfig(dir);
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["task_type"], "CAUSAL_LM");
  EXPECT_EQ(c["r"], 4);
  EXPECT_TRUE(c["lora_alpha"].is_number_integer());
  EXPECT_EQ(c["lora_alpha"], 8);
  EXPECT_EQ(c["target_modules"], OrderedJson({"q_proj", "down_proj"}));
  EXPECT_EQ(c["use_rslora"], true);
  EXPECT_EQ(c["bias"], "none");
  EXPECT_EQ(c["fan_in_fan_out"], false);
  EXPECT_EQ(c["layers_to_transform"], OrderedJson({0, 2}));
  EXPECT_EQ(c["preft_positions"], "prompt");
  EXPECT_EQ(c["base_model_name_or_path"], "llama");

  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  const model::AdapterWeights& w = **a;
  EXPECT_EQ(w.default_positions, AdapterPositions::kPrompt);
  const std::vector<Tensor> file = ReadTensors(dir);
  for (const Tensor& t : file) EXPECT_EQ(t.dtype, DType::kBF16) << t.name;
  for (int64_t l = 0; l < 3; ++l) {
    for (int p = 0; p < model::kNumProjections; ++p) {
      const Projection proj = static_cast<Projection>(p);
      const model::LowRank& lr = w.lora(l, proj);
      const bool expected = l != 1 && (proj == Projection::kQ || proj == Projection::kDown);
      ASSERT_EQ(lr.empty(), !expected) << l << " " << model::ProjectionName(proj);
      if (!expected) continue;
      EXPECT_FLOAT_EQ(lr.scale, 4.0f);  // 8 / sqrt(4)
      const std::string prefix = "base_model.model.model.layers." + std::to_string(l) +
                                 (proj == Projection::kQ ? ".self_attn.q_proj" : ".mlp.down_proj");
      const Tensor& A = Named(file, prefix + ".lora_A.weight");
      const Tensor& B = Named(file, prefix + ".lora_B.weight");
      ASSERT_EQ(lr.shrink.cols, A.shape[1]);
      for (int64_t i = 0; i < 4 * A.shape[1]; ++i) {
        ASSERT_EQ(kernels::LoadAsF32(lr.shrink.data, lr.shrink.dtype, i), A.values[i]);
      }
      for (int64_t o = 0; o < B.shape[0]; ++o) {
        for (int64_t r = 0; r < 4; ++r) ASSERT_EQ(At(lr.expand, r, o), B.values[o * 4 + r]);
      }
    }
  }
}

TEST(MakeAdapterTest, DireftRoundTrips) {
  RandomAdapterSpec spec;
  spec.kind = AdapterKind::kDireft;
  spec.rank = 2;
  spec.layers = {2, 0};
  spec.prompt_positions = "f3+l2";
  spec.seed = 3;
  const std::string dir = TempDir("direft_round_trip");
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, dir).ok());
  const OrderedJson c = ReadConfig(dir);
  EXPECT_EQ(c["peft_type"], "DIREFT");
  EXPECT_EQ(c["layers"], OrderedJson({0, 2}));
  EXPECT_EQ(c["prompt_positions"], "f3+l2");
  EXPECT_FALSE(c.contains("preft_positions"));

  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  const model::AdapterWeights& w = **a;
  EXPECT_EQ(w.kind(), AdapterKind::kDireft);
  EXPECT_EQ(w.default_positions, AdapterPositions::kAll);
  EXPECT_EQ(w.prompt_selection.ToString(), "f3+l2");
  EXPECT_TRUE(w.direft(1).empty());
  const std::vector<Tensor> file = ReadTensors(dir);
  for (int64_t l : {0, 2}) {
    const model::LowRank& lr = w.direft(l);
    ASSERT_FALSE(lr.empty());
    EXPECT_EQ(lr.rank(), 2);
    const std::string p = "layers." + std::to_string(l) + ".direft.";
    EXPECT_EQ(At(lr.shrink, 1, 63), Named(file, p + "learned_source.weight").values[127]);
    EXPECT_EQ(At(lr.expand, 0, 5), Named(file, p + "proj_layer.weight").values[5]);
    EXPECT_EQ(lr.shrink_bias[1], Named(file, p + "learned_source.bias").values[1]);
  }
}

TEST(MakeAdapterTest, SeedDeterminesEveryTensor) {
  RandomAdapterSpec spec;
  spec.seed = 11;
  const std::string a = TempDir("seed_a"), b = TempDir("seed_b"), c = TempDir("seed_c"),
                    d = TempDir("seed_d");
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, a).ok());
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, b).ok());
  EXPECT_EQ(ReadText(a + "/adapter_model.safetensors"), ReadText(b + "/adapter_model.safetensors"));
  spec.seed = 12;
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, c).ok());
  EXPECT_NE(ReadText(a + "/adapter_model.safetensors"), ReadText(c + "/adapter_model.safetensors"));
  // A tensor depends only on the seed and its name, not on what else is written.
  spec.seed = 11;
  spec.targets = {Projection::kV};
  ASSERT_TRUE(WriteRandomAdapter(TinyConfig(), spec, d).ok());
  const std::string v = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
  EXPECT_EQ(Named(ReadTensors(a), v).values, Named(ReadTensors(d), v).values);
}

// Relative size of the random updates against make-model's weights: large enough to change a
// tiny model's greedy output, small enough not to swamp it (make_adapter.h: about 0.3).
TEST(MakeAdapterTest, UpdatesAreAFractionOfTheBase) {
  const std::string model_dir = TempDir("base_model");
  model::MakeModelOptions mo;
  mo.out_dir = model_dir;
  mo.seed = 5;
  ASSERT_TRUE(model::MakeModel(mo).ok());
  auto base = model::ModelConfig::FromFile(model_dir + "/config.json");
  ASSERT_TRUE(base.ok()) << base.status();
  auto weights = model::SafetensorsFile::Open(model_dir + "/model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();

  for (double alpha : {16.0, 4.0}) {
    RandomAdapterSpec spec;
    spec.alpha = alpha;
    spec.seed = 1;
    const std::string dir = TempDir("magnitude_lora");
    ASSERT_TRUE(WriteRandomAdapter(*base, spec, dir).ok());
    auto adapter = LoadAdapter(dir, *base);
    ASSERT_TRUE(adapter.ok()) << adapter.status();
    std::mt19937_64 gen(3);
    std::normal_distribution<double> normal;
    const std::pair<const char*, Projection> modules[] = {{"self_attn.q_proj", Projection::kQ},
                                                          {"self_attn.v_proj", Projection::kV},
                                                          {"mlp.down_proj", Projection::kDown}};
    for (const auto& [module, p] : modules) {
      const std::string name = std::string("model.layers.1.") + module + ".weight";
      const model::TensorInfo* t = (*weights)->Find(name);
      ASSERT_NE(t, nullptr) << name;
      const int64_t out = t->shape[0], in = t->shape[1];
      const model::LowRank& lr = (*adapter)->lora(1, p);
      ASSERT_EQ(lr.shrink.cols, in);
      ASSERT_EQ(lr.expand.cols, out);
      double base_sq = 0, update_sq = 0;
      for (int sample = 0; sample < 32; ++sample) {
        std::vector<double> x(in), ax(lr.rank(), 0.0);
        for (double& v : x) v = normal(gen);
        for (int64_t o = 0; o < out; ++o) {
          double y = 0;
          for (int64_t i = 0; i < in; ++i)
            y += kernels::LoadAsF32(t->data, t->dtype, o * in + i) * x[i];
          base_sq += y * y;
        }
        for (int64_t r = 0; r < lr.rank(); ++r) {
          for (int64_t i = 0; i < in; ++i) ax[r] += At(lr.shrink, r, i) * x[i];
        }
        for (int64_t o = 0; o < out; ++o) {
          double y = 0;
          for (int64_t r = 0; r < lr.rank(); ++r) y += ax[r] * At(lr.expand, r, o);
          update_sq += (lr.scale * y) * (lr.scale * y);
        }
      }
      const double ratio = std::sqrt(update_sq / base_sq);
      EXPECT_GT(ratio, 0.2) << module << " alpha " << alpha;
      EXPECT_LT(ratio, 0.45) << module << " alpha " << alpha;
    }
  }

  RandomAdapterSpec spec;
  spec.kind = AdapterKind::kDireft;
  spec.seed = 2;
  const std::string dir = TempDir("magnitude_direft");
  ASSERT_TRUE(WriteRandomAdapter(*base, spec, dir).ok());
  auto adapter = LoadAdapter(dir, *base);
  ASSERT_TRUE(adapter.ok()) << adapter.status();
  const model::LowRank& lr = (*adapter)->direft(0);
  std::mt19937_64 gen(4);
  std::normal_distribution<double> normal;
  double h_sq = 0, update_sq = 0;
  for (int sample = 0; sample < 32; ++sample) {
    std::vector<double> h(base->hidden_size);
    for (double& v : h) v = normal(gen);
    std::vector<double> z(lr.rank());
    for (int64_t r = 0; r < lr.rank(); ++r) {
      z[r] = lr.shrink_bias[r];
      for (int64_t i = 0; i < base->hidden_size; ++i) z[r] += At(lr.shrink, r, i) * h[i];
    }
    for (int64_t i = 0; i < base->hidden_size; ++i) {
      double u = 0;
      for (int64_t r = 0; r < lr.rank(); ++r) u += z[r] * At(lr.expand, r, i);
      update_sq += u * u;
      h_sq += h[i] * h[i];
    }
  }
  const double ratio = std::sqrt(update_sq / h_sq);
  EXPECT_GT(ratio, 0.2);
  EXPECT_LT(ratio, 0.45);
}

TEST(MakeAdapterTest, RefusesBadSpecs) {
  const model::ModelConfig base = TinyConfig();
  const std::string dir = TempDir("bad_specs");
  auto expect = [&](const RandomAdapterSpec& spec, const std::string& substring,
                    const std::string& out) {
    absl::Status s = WriteRandomAdapter(base, spec, out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(substring));
  };
  RandomAdapterSpec spec;
  spec.rank = 0;
  expect(spec, "rank must be in [1, 65536], got 0", dir);
  spec = {};
  spec.layers = {0, 3};
  expect(spec, "layer 3 is out of range", dir);
  spec = {};
  spec.layers = {1, 1};
  expect(spec, "layer 1 is listed twice", dir);
  spec = {};
  spec.targets = {};
  expect(spec, "at least one target", dir);
  spec = {};
  spec.targets = {Projection::kQ, Projection::kQ};
  expect(spec, "q_proj is listed twice", dir);
  spec = {};
  spec.alpha = 0;
  expect(spec, "alpha must be a positive number", dir);
  spec = {};
  spec.prompt_positions = "f3";
  expect(spec, "DiReFT only", dir);
  spec = {};
  spec.kind = AdapterKind::kDireft;
  spec.prompt_positions = "middle";
  expect(spec, "prompt positions \"middle\"", dir);
  expect({}, "output folder is empty", "");
}

}  // namespace
}  // namespace preft::adapters

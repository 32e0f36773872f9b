#include "common/adapters/adapter_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/kernels/cpu/low_rank.h"
#include "common/model/adapter_weights.h"
#include "tests/adapters/adapter_test_util.h"

namespace preft::adapters {
namespace {

using kernels::DType;
using model::AdapterKind;
using model::AdapterPositions;
using model::Projection;
using model::PromptSelection;
using namespace ::preft::adapters::testing;  // NOLINT: test helpers

constexpr Projection kAll[] = {Projection::kQ,    Projection::kK,  Projection::kV,   Projection::kO,
                               Projection::kGate, Projection::kUp, Projection::kDown};

std::string LoraKeyName(int64_t layer, Projection p, const char* ab) {
  const bool attn = static_cast<int>(p) <= static_cast<int>(Projection::kO);
  return "base_model.model.model.layers." + std::to_string(layer) +
         (attn ? ".self_attn." : ".mlp.") + model::ProjectionName(p) + ".lora_" + ab + ".weight";
}

std::map<std::string, Tensor> ByName(const std::vector<Tensor>& tensors) {
  std::map<std::string, Tensor> m;
  for (const Tensor& t : tensors) m[t.name] = t;
  return m;
}

// shrink == A [r, in] and expand == B^T (B is [out, r]), element by element, in f32.
void ExpectLoraMatches(const model::LowRank& lr, const Tensor& a, const Tensor& b) {
  ASSERT_FALSE(lr.empty());
  const int64_t r = a.shape[0], in = a.shape[1], out = b.shape[0];
  ASSERT_EQ(lr.shrink.rows, r);
  ASSERT_EQ(lr.shrink.cols, in);
  ASSERT_EQ(lr.expand.rows, r);
  ASSERT_EQ(lr.expand.cols, out);
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < in; ++j) ASSERT_EQ(At(lr.shrink, i, j), a.values[i * in + j]);
    for (int64_t o = 0; o < out; ++o) ASSERT_EQ(At(lr.expand, i, o), b.values[o * r + i]);
  }
  EXPECT_EQ(lr.shrink_bias, nullptr);
}

TEST(AdapterLoaderTest, LoadsFixtureLora) {
  const model::ModelConfig base = TinyConfig();
  auto a = LoadAdapter(FixtureAdapter("lora"), base);
  ASSERT_TRUE(a.ok()) << a.status();
  const model::AdapterWeights& w = **a;
  EXPECT_EQ(w.kind(), AdapterKind::kLora);
  EXPECT_EQ(w.dtype(), DType::kF32);
  EXPECT_EQ(w.num_layers(), 3);
  EXPECT_EQ(w.max_rank(), 8);
  EXPECT_EQ(w.default_positions, AdapterPositions::kAll);
  auto file = ByName(ReadTensors(FixtureAdapter("lora")));
  for (int64_t l = 0; l < 3; ++l) {
    for (Projection p : kAll) {
      SCOPED_TRACE(LoraKeyName(l, p, "A"));
      const model::LowRank& lr = w.lora(l, p);
      ExpectLoraMatches(lr, file.at(LoraKeyName(l, p, "A")), file.at(LoraKeyName(l, p, "B")));
      EXPECT_EQ(lr.scale, 2.0f);  // 16 / 8
    }
  }
}

TEST(AdapterLoaderTest, LoadsFixtureRsLoraOnQAndVOnly) {
  auto a = LoadAdapter(FixtureAdapter("lora_rs"), TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  auto file = ByName(ReadTensors(FixtureAdapter("lora_rs")));
  for (int64_t l = 0; l < 3; ++l) {
    for (Projection p : kAll) {
      const model::LowRank& lr = (*a)->lora(l, p);
      if (p == Projection::kQ || p == Projection::kV) {
        ExpectLoraMatches(lr, file.at(LoraKeyName(l, p, "A")), file.at(LoraKeyName(l, p, "B")));
        EXPECT_FLOAT_EQ(lr.scale, static_cast<float>(16.0 / std::sqrt(8.0)));
      } else {
        EXPECT_TRUE(lr.empty()) << model::ProjectionName(p);
      }
    }
  }
}

TEST(AdapterLoaderTest, LoadsFixtureDireft) {
  auto a = LoadAdapter(FixtureAdapter("direft"), TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  const model::AdapterWeights& w = **a;
  EXPECT_EQ(w.kind(), AdapterKind::kDireft);
  EXPECT_TRUE(w.prompt_selection.all);
  EXPECT_EQ(w.default_positions, AdapterPositions::kAll);
  EXPECT_EQ(w.max_rank(), 4);
  auto file = ByName(ReadTensors(FixtureAdapter("direft")));
  for (int64_t l = 0; l < 3; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".direft.";
    const Tensor& w1 = file.at(p + "learned_source.weight");
    const Tensor& b1 = file.at(p + "learned_source.bias");
    const Tensor& w2 = file.at(p + "proj_layer.weight");
    const model::LowRank& lr = w.direft(l);
    ASSERT_FALSE(lr.empty());
    ASSERT_EQ(lr.shrink.rows, 4);
    ASSERT_EQ(lr.shrink.cols, 64);
    ASSERT_EQ(lr.expand.rows, 4);
    ASSERT_EQ(lr.expand.cols, 64);
    EXPECT_EQ(lr.scale, 1.0f);
    ASSERT_NE(lr.shrink_bias, nullptr);
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(lr.shrink_bias[i], b1.values[i]);
      for (int64_t j = 0; j < 64; ++j) {
        ASSERT_EQ(At(lr.shrink, i, j), w1.values[i * 64 + j]);
        ASSERT_EQ(At(lr.expand, i, j), w2.values[i * 64 + j]);
      }
    }
  }
}

TEST(AdapterLoaderTest, ConvertsToBf16) {
  LoadOptions o;
  o.dtype = DType::kBF16;
  auto a = LoadAdapter(FixtureAdapter("lora"), TinyConfig(), o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->dtype(), DType::kBF16);
  const model::LowRank& lr = (*a)->lora(1, Projection::kDown);
  EXPECT_EQ(lr.shrink.dtype, DType::kBF16);
  auto file = ByName(ReadTensors(FixtureAdapter("lora")));
  const Tensor& A = file.at(LoraKeyName(1, Projection::kDown, "A"));
  const Tensor& B = file.at(LoraKeyName(1, Projection::kDown, "B"));
  const uint16_t* s = static_cast<const uint16_t*>(lr.shrink.data);
  const uint16_t* e = static_cast<const uint16_t*>(lr.expand.data);
  for (int64_t i = 0; i < 8 * 160; ++i) ASSERT_EQ(s[i], kernels::F32ToBf16(A.values[i]));
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t o2 = 0; o2 < 64; ++o2) {
      ASSERT_EQ(e[i * 64 + o2], kernels::F32ToBf16(B.values[o2 * 8 + i]));
    }
  }

  // DiReFT: matrices converted, the bias stays f32.
  auto d = LoadAdapter(FixtureAdapter("direft"), TinyConfig(), o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->direft(0).expand.dtype, DType::kBF16);
  EXPECT_EQ((*d)->direft(0).shrink_bias[0], ByName(ReadTensors(FixtureAdapter("direft")))
                                                .at("layers.0.direft.learned_source.bias")
                                                .values[0]);
}

// LoadOptions::cpu_layout writes each chunkable pair in the CPU kernels' chunked order: the
// row-major copy's bits, rearranged; from a file in another dtype (the converting loop) and
// from one in the compute dtype (bits copied, B transposed straight into chunks).
TEST(AdapterLoaderTest, CpuLayoutWritesTheChunkedOrderOfTheRowMajorCopy) {
  if (!kernels::cpu::LowRankChunkable(kernels::MatrixView{nullptr, DType::kBF16, 8, 64})) {
    GTEST_SKIP() << "this CPU's kernels take no chunked matrices";
  }
  const std::string bf16_dir = CopyFixture("lora", "lora_bf16_file");
  std::vector<Tensor> tensors = ReadTensors(bf16_dir);
  for (Tensor& t : tensors) t.dtype = DType::kBF16;
  WriteTensors(bf16_dir, tensors);
  int chunked_pairs = 0;
  for (const std::string& dir : {FixtureAdapter("lora"), bf16_dir, FixtureAdapter("direft")}) {
    SCOPED_TRACE(dir);
    LoadOptions o;
    o.dtype = DType::kBF16;
    auto row = LoadAdapter(dir, TinyConfig(), o);
    o.cpu_layout = true;
    auto chunk = LoadAdapter(dir, TinyConfig(), o);
    ASSERT_TRUE(row.ok() && chunk.ok());
    auto same = [&](const model::LowRank& r, const model::LowRank& c) {
      if (r.empty()) return;
      ASSERT_TRUE(c.shrink.chunked && c.expand.chunked);
      ASSERT_TRUE(!c.shrink.paired && c.expand.paired);  // the expand's rows in pairs
      for (auto [rm, cm] : {std::pair{r.shrink, c.shrink}, std::pair{r.expand, c.expand}}) {
        std::vector<uint16_t> want(rm.rows * rm.cols);
        kernels::cpu::ChunkColumns(static_cast<const uint16_t*>(rm.data), rm.rows, rm.cols,
                                   cm.paired, want.data());
        ASSERT_EQ(0, std::memcmp(want.data(), cm.data, want.size() * 2));
      }
      ++chunked_pairs;
    };
    // A copy into another dtype is row-major again, with the row-major copy's values.
    auto row_f32 = (*row)->ConvertTo(DType::kF32), chunk_f32 = (*chunk)->ConvertTo(DType::kF32);
    const model::LowRank& rf = (*row)->kind() == model::AdapterKind::kDireft
                                   ? row_f32->direft(0)
                                   : row_f32->lora(0, Projection::kQ);
    const model::LowRank& cf = (*row)->kind() == model::AdapterKind::kDireft
                                   ? chunk_f32->direft(0)
                                   : chunk_f32->lora(0, Projection::kQ);
    ASSERT_FALSE(rf.empty());
    ASSERT_FALSE(cf.expand.chunked);
    ASSERT_EQ(0, std::memcmp(rf.expand.data, cf.expand.data,
                             rf.expand.rows * rf.expand.cols * sizeof(float)));
    for (int64_t l = 0; l < (*row)->num_layers(); ++l) {
      if ((*row)->kind() == model::AdapterKind::kDireft) {
        same((*row)->direft(l), (*chunk)->direft(l));
        continue;
      }
      for (int p = 0; p < model::kNumProjections; ++p) {
        same((*row)->lora(l, static_cast<Projection>(p)), (*chunk)->lora(l, static_cast<Projection>(p)));
      }
    }
  }
  EXPECT_GT(chunked_pairs, 8);
}

TEST(AdapterLoaderTest, ReadsBf16AndF16Files) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const std::string dir = CopyFixture("lora_rs", std::string("halves_") + kernels::DTypeName(dt));
    std::vector<Tensor> tensors = ReadTensors(dir);
    for (Tensor& t : tensors) t.dtype = dt;
    WriteTensors(dir, tensors);
    auto a = LoadAdapter(dir, TinyConfig());
    ASSERT_TRUE(a.ok()) << a.status();
    const Tensor& A = tensors[0];  // sorted: layers.0...q_proj.lora_A
    ASSERT_EQ(A.name, LoraKeyName(0, Projection::kQ, "A"));
    const float expected = dt == DType::kBF16 ? kernels::Bf16ToF32(kernels::F32ToBf16(A.values[5]))
                                              : kernels::F16ToF32(kernels::F32ToF16(A.values[5]));
    EXPECT_EQ(At((*a)->lora(0, Projection::kQ).shrink, 0, 5), expected);
  }
}

// PEFT resets fan_in_fan_out to false for nn.Linear bases, and lora_A / lora_B are nn.Linear
// either way: the flag must not change how the tensors are read.
TEST(AdapterLoaderTest, FanInFanOutDoesNotChangeTheLayout) {
  const std::string dir = CopyFixture("lora", "fan_in_fan_out");
  EditConfig(dir, [](OrderedJson& j) { j["fan_in_fan_out"] = true; });
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  auto file = ByName(ReadTensors(dir));
  ExpectLoraMatches((*a)->lora(2, Projection::kO), file.at(LoraKeyName(2, Projection::kO, "A")),
                    file.at(LoraKeyName(2, Projection::kO, "B")));
}

// Writes lora_A / lora_B for (layer, projection, rank) modules of the tiny model.
struct Module {
  int64_t layer;
  Projection p;
  int64_t rank;
};
void WriteModules(const std::string& dir, const std::vector<Module>& modules,
                  bool legacy_names = false) {
  const model::ModelConfig c = TinyConfig();
  std::vector<Tensor> tensors;
  float offset = 0;
  for (const Module& m : modules) {
    int64_t in = c.hidden_size, out = c.hidden_size;
    switch (m.p) {
      case Projection::kK:
      case Projection::kV:
        out = c.num_kv_heads * c.head_dim;
        break;
      case Projection::kGate:
      case Projection::kUp:
        out = c.intermediate_size;
        break;
      case Projection::kDown:
        in = c.intermediate_size;
        break;
      default:
        break;
    }
    std::string a = LoraKeyName(m.layer, m.p, "A"), b = LoraKeyName(m.layer, m.p, "B");
    if (legacy_names) {  // no "base_model.model." prefix, adapter name in the key
      a = a.substr(17).replace(a.size() - 17 - 7, 7, ".default.weight");
      b = b.substr(17).replace(b.size() - 17 - 7, 7, ".default.weight");
    }
    tensors.push_back(Ramp(a, {m.rank, in}, offset += 1));
    tensors.push_back(Ramp(b, {out, m.rank}, offset += 1));
  }
  WriteTensors(dir, tensors);
}

OrderedJson LoraConfig(OrderedJson targets) {
  return {{"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"},  {"r", 8},
          {"lora_alpha", 16},    {"target_modules", targets}, {"bias", "none"}};
}

TEST(AdapterLoaderTest, RankAndAlphaPatternFollowPeft) {
  const std::string dir = TempDir("patterns");
  OrderedJson c = LoraConfig({"q_proj", "v_proj", "down_proj"});
  // Keys are tried in order: rank_pattern's, then alpha_pattern's; the first key k with
  // re.match(".*\.k$", module) decides both r and alpha.
  c["rank_pattern"] = {
      {"q_proj", 4}, {"layers.0.self_attn.v_proj", 2}, {"model.layers.1.mlp.down_proj", 6}};
  c["alpha_pattern"] = {{"v_proj", 32}, {"q_proj", 64}};
  WriteConfig(dir, c);
  WriteModules(dir, {{0, Projection::kQ, 4},
                     {0, Projection::kV, 2},
                     {1, Projection::kV, 8},
                     {0, Projection::kDown, 8},
                     {1, Projection::kDown, 6}});
  // Only the listed modules have tensors, so restrict the targets to them via a regex.
  EditConfig(dir, [](OrderedJson& j) {
    j["target_modules"] =
        R"(model\.layers\.0\.self_attn\.(q|v)_proj|model\.layers\.[01]\.(self_attn\.v|mlp\.down)_proj)";
  });
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  const model::AdapterWeights& w = **a;
  // q_proj: rank_pattern key "q_proj" matches first: r 4, alpha from alpha_pattern["q_proj"].
  EXPECT_EQ(w.lora(0, Projection::kQ).rank(), 4);
  EXPECT_FLOAT_EQ(w.lora(0, Projection::kQ).scale, 64.0f / 4);
  // layer 0 v_proj: "layers.0.self_attn.v_proj" matches before alpha_pattern's "v_proj", so
  // alpha stays 16 (PEFT looks the same key up in both).
  EXPECT_EQ(w.lora(0, Projection::kV).rank(), 2);
  EXPECT_FLOAT_EQ(w.lora(0, Projection::kV).scale, 16.0f / 2);
  // layer 1 v_proj: only "v_proj" (alpha_pattern) matches: r 8, alpha 32.
  EXPECT_EQ(w.lora(1, Projection::kV).rank(), 8);
  EXPECT_FLOAT_EQ(w.lora(1, Projection::kV).scale, 32.0f / 8);
  // layer 0 down_proj: nothing matches: r 8, alpha 16.
  EXPECT_FLOAT_EQ(w.lora(0, Projection::kDown).scale, 2.0f);
  // layer 1 down_proj: ".*\.model.layers.1.mlp.down_proj$" needs a prefix and fails, but the
  // module's full name is then looked up exactly: r 6.
  EXPECT_EQ(w.lora(1, Projection::kDown).rank(), 6);
  EXPECT_FLOAT_EQ(w.lora(1, Projection::kDown).scale, 16.0f / 6);
  EXPECT_TRUE(w.lora(1, Projection::kQ).empty());
}

TEST(AdapterLoaderTest, RegexTargetModulesAreFullMatched) {
  const std::string dir = TempDir("regex");
  WriteConfig(dir, LoraConfig(R"(.*\.(q|v)_proj)"));
  std::vector<Module> modules;
  for (int64_t l = 0; l < 3; ++l) {
    modules.push_back({l, Projection::kQ, 8});
    modules.push_back({l, Projection::kV, 8});
  }
  WriteModules(dir, modules);
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE((*a)->lora(2, Projection::kV).empty());
  EXPECT_TRUE((*a)->lora(2, Projection::kK).empty());

  // "q_proj" alone does not full-match "model.layers.0.self_attn.q_proj": the tensors are then
  // for modules the config does not select.
  EditConfig(dir, [](OrderedJson& j) { j["target_modules"] = "q_proj"; });
  auto b = LoadAdapter(dir, TinyConfig());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), ::testing::HasSubstr("matches none"));

  EditConfig(dir, [](OrderedJson& j) { j["target_modules"] = R"(.*self_attn\.q_proj)"; });
  auto c = LoadAdapter(dir, TinyConfig());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), ::testing::HasSubstr("does not select"));
}

TEST(AdapterLoaderTest, AcceptsLegacyTensorNames) {
  const std::string dir = TempDir("legacy");
  WriteConfig(dir, LoraConfig({"k_proj"}));
  WriteModules(dir, {{0, Projection::kK, 8}, {1, Projection::kK, 8}, {2, Projection::kK, 8}},
               /*legacy_names=*/true);
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->lora(2, Projection::kK).rank(), 8);
  EXPECT_FLOAT_EQ(At((*a)->lora(0, Projection::kK).shrink, 0, 1), 1.001f);
}

TEST(AdapterLoaderTest, LayersToTransformNarrowsTheTargets) {
  const std::string dir = TempDir("layers_to_transform");
  OrderedJson c = LoraConfig({"up_proj"});
  c["layers_to_transform"] = {1};
  WriteConfig(dir, c);
  WriteModules(dir, {{1, Projection::kUp, 8}});
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE((*a)->lora(1, Projection::kUp).empty());
  EXPECT_TRUE((*a)->lora(0, Projection::kUp).empty());
}

TEST(AdapterLoaderTest, PreftPositionsSetTheDefault) {
  const std::string dir = CopyFixture("direft", "positions");
  EditConfig(dir, [](OrderedJson& j) {
    j["preft_positions"] = "prompt";
    j["prompt_positions"] = "f3+l2";
  });
  auto a = LoadAdapter(dir, TinyConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->default_positions, AdapterPositions::kPrompt);
  EXPECT_FALSE((*a)->prompt_selection.all);
  EXPECT_EQ((*a)->prompt_selection.first, 3);
  EXPECT_EQ((*a)->prompt_selection.last, 2);

  EditConfig(dir, [](OrderedJson& j) {
    j["layers"] = "all";
    j["act_fn"] = nullptr;
  });
  EXPECT_TRUE(LoadAdapter(dir, TinyConfig()).ok());
}

TEST(PromptSelectionTest, ParsesAndSelects) {
  PromptSelection s;
  ASSERT_TRUE(PromptSelection::Parse("all", &s));
  EXPECT_TRUE(s.all);
  EXPECT_TRUE(s.Selected(0, 1));
  EXPECT_EQ(s.ToString(), "all");

  ASSERT_TRUE(PromptSelection::Parse("f3+l2", &s));
  EXPECT_FALSE(s.all);
  EXPECT_EQ(s.first, 3);
  EXPECT_EQ(s.last, 2);
  EXPECT_EQ(s.ToString(), "f3+l2");
  std::vector<int64_t> picked;
  for (int64_t p = 0; p < 10; ++p) {
    if (s.Selected(p, 10)) picked.push_back(p);
  }
  EXPECT_THAT(picked, ::testing::ElementsAre(0, 1, 2, 8, 9));

  ASSERT_TRUE(PromptSelection::Parse("f2", &s));
  EXPECT_EQ(s.last, 0);
  EXPECT_TRUE(s.Selected(1, 10));
  EXPECT_FALSE(s.Selected(9, 10));
  ASSERT_TRUE(PromptSelection::Parse("l1", &s));
  EXPECT_EQ(s.first, 0);
  EXPECT_TRUE(s.Selected(9, 10));
  EXPECT_FALSE(s.Selected(0, 10));

  for (const char* bad : {"", "f", "l", "first3", "f3l2", "f-1", "3", "f3+l2+l1", "all "}) {
    EXPECT_FALSE(PromptSelection::Parse(bad, &s)) << bad;
  }
}

TEST(PromptSelectionTest, ClampsToHalfThePrompt) {
  // pyreft's get_intervention_locations: first_n and last_n are each at most prompt_len / 2.
  PromptSelection s;
  ASSERT_TRUE(PromptSelection::Parse("f5+l5", &s));
  std::vector<int64_t> picked;
  for (int64_t p = 0; p < 5; ++p) {
    if (s.Selected(p, 5)) picked.push_back(p);
  }
  EXPECT_THAT(picked, ::testing::ElementsAre(0, 1, 3, 4));  // 5 / 2 = 2 from each end
  EXPECT_FALSE(s.Selected(0, 1));                           // 1 / 2 = 0: nothing
  EXPECT_FALSE(s.Selected(5, 5));                           // not a prompt position
}

}  // namespace
}  // namespace preft::adapters

// The trainer's autograd gradients against central finite differences in double, for every
// adapter mode (LoRA, LoRAP, DiReFT, DiReFTP; rsLoRA, a layer subset, pyreft's fN+lM).

#include <gtest/gtest.h>

#include <random>

#include "tests/train/train_test_util.h"
#include "train/example_batch.h"
#include "train/torch_model.h"
#include "train/trainable_adapter.h"

namespace preft::train {
namespace {

using model::AdapterKind;
using model::AdapterPositions;
using model::Projection;

struct GradCase {
  std::string name;
  std::string preset;
  adapters::AdapterSpec spec;
  AdapterPositions positions;
};

std::vector<GradCase> Cases() {
  std::vector<GradCase> cases;
  adapters::AdapterSpec lora;
  lora.rank = 4;
  lora.alpha = 8;
  cases.push_back({"lora_all", "tiny", lora, AdapterPositions::kAll});
  adapters::AdapterSpec lorap = lora;
  lorap.use_rslora = true;
  lorap.layers = {0, 2};
  lorap.targets = {Projection::kQ, Projection::kV, Projection::kO, Projection::kDown};
  cases.push_back({"lorap_rslora_layers", "tiny-qwen2", lorap, AdapterPositions::kPrompt});
  adapters::AdapterSpec direft;
  direft.kind = AdapterKind::kDireft;
  direft.rank = 3;
  cases.push_back({"direft_all", "tiny-mistral", direft, AdapterPositions::kAll});
  adapters::AdapterSpec direftp = direft;
  direftp.layers = {1};
  direftp.prompt_positions = "f2+l1";
  cases.push_back({"direftp_f2l1", "tiny", direftp, AdapterPositions::kPrompt});
  return cases;
}

class GradientTest : public ::testing::TestWithParam<GradCase> {};

TEST_P(GradientTest, AutogradMatchesCentralDifferencesInDouble) {
  const GradCase& c = GetParam();
  at::set_num_threads(1);
  auto m = TorchModel::Load(testing::TinyModel(c.preset), torch::kFloat64);
  ASSERT_TRUE(m.ok()) << m.status();
  auto a = TrainableAdapter::Create((*m)->config(), c.spec, 3, torch::kFloat64);
  ASSERT_TRUE(a.ok()) << a.status();
  {  // Every tensor non-zero, so every path carries gradient.
    torch::NoGradGuard no_grad;
    torch::manual_seed(11);
    for (torch::Tensor& t : (*a)->parameters()) t.normal_(0, 0.2);
  }
  // Two examples of different lengths in one padded batch.
  std::mt19937 rng(5);
  auto ids = [&](int n) {
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = static_cast<int32_t>(rng() % (*m)->config().vocab_size);
    return v;
  };
  const Example e1{ids(6), ids(3), "e1"}, e2{ids(9), ids(2), "e2"};
  const ExampleBatch b = MakeExampleBatch({&e1, &e2}, {c.positions, (*a)->prompt_selection()},
                                          torch::kFloat64);
  auto loss = [&] { return -CompletionLogprobs(**m, a->get(), b).sum(); };

  torch::Tensor l = loss();
  l.backward();
  const double eps = 1e-6;
  int checked = 0, nonzero = 0;
  for (const auto& [name, p] : (*a)->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    const torch::Tensor flat = p.view({-1});
    const torch::Tensor grad = p.grad().view({-1});
    for (int k = 0; k < 3; ++k) {
      const int64_t i = static_cast<int64_t>(rng() % flat.numel());
      double plus, minus;
      {
        torch::NoGradGuard no_grad;
        const double x = flat[i].item<double>();
        flat[i] = x + eps;
        plus = loss().item<double>();
        flat[i] = x - eps;
        minus = loss().item<double>();
        flat[i] = x;
      }
      const double fd = (plus - minus) / (2 * eps);
      const double g = grad[i].item<double>();
      EXPECT_NEAR(g, fd, 1e-6 + 1e-6 * std::abs(fd)) << c.name << " " << name << "[" << i << "]";
      ++checked;
      nonzero += std::abs(g) > 1e-8;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_GT(nonzero, checked / 2) << "most sampled gradients should be non-zero";
}

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

INSTANTIATE_TEST_SUITE_P(Modes, GradientTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// The masks are the engine's (common/engine/engine.cc): prompt tokens (DiReFT: the selected
// ones), completion tokens only with all positions.
TEST(ExampleBatchTest, MasksFollowTheServersRule) {
  const Example e{{10, 11, 12, 13, 14}, {20, 21, 22}, "e"};
  model::PromptSelection f1l1;
  ASSERT_TRUE(model::PromptSelection::Parse("f1+l1", &f1l1));
  const ExampleBatch prompt = MakeExampleBatch({&e}, {AdapterPositions::kPrompt, f1l1},
                                               torch::kFloat32);
  // Inputs: the 5 prompt tokens and the first 2 completion tokens.
  EXPECT_EQ(prompt.batch.ids.size(1), 7);
  const std::vector<float> lora_prompt = {1, 1, 1, 1, 1, 0, 0};
  const std::vector<float> direft_prompt = {1, 0, 0, 0, 1, 0, 0};
  for (int t = 0; t < 7; ++t) {
    EXPECT_EQ(prompt.batch.lora_mask[0][t][0].item<float>(), lora_prompt[t]) << t;
    EXPECT_EQ(prompt.batch.direft_mask[0][t][0].item<float>(), direft_prompt[t]) << t;
  }
  const ExampleBatch all = MakeExampleBatch({&e}, {AdapterPositions::kAll, f1l1}, torch::kFloat32);
  const std::vector<float> direft_all = {1, 0, 0, 0, 1, 1, 1};
  for (int t = 0; t < 7; ++t) {
    EXPECT_EQ(all.batch.lora_mask[0][t][0].item<float>(), 1.f) << t;
    EXPECT_EQ(all.batch.direft_mask[0][t][0].item<float>(), direft_all[t]) << t;
  }
  // The first completion token is predicted from the last prompt position.
  EXPECT_EQ(prompt.batch.logit_rows[0].item<int64_t>(), 4);
  EXPECT_EQ(prompt.targets[0].item<int64_t>(), 20);
  EXPECT_EQ(prompt.batch.logit_rows[2].item<int64_t>(), 6);
}

}  // namespace
}  // namespace preft::train

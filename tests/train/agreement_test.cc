// The trainer's forward against the engine's: the logprob of every generated token, recomputed
// by the trainer from (prompt, generated tokens), equals what the engine reported, within 1e-4
// on f32 models, for the base and the four adapter modes, mixed prompt lengths in one batch,
// and adapters read back from the files the engine loaded.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"

#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "tests/train/train_test_util.h"
#include "train/example_batch.h"
#include "train/torch_model.h"
#include "train/trainable_adapter.h"

namespace preft::train {
namespace {

using model::AdapterKind;
using model::AdapterPositions;

struct Mode {
  std::string name;
  bool adapter;
  AdapterKind kind;
  AdapterPositions positions;
};

const Mode kModes[] = {{"base", false, AdapterKind::kLora, AdapterPositions::kAll},
                       {"lora", true, AdapterKind::kLora, AdapterPositions::kAll},
                       {"lorap", true, AdapterKind::kLora, AdapterPositions::kPrompt},
                       {"direft", true, AdapterKind::kDireft, AdapterPositions::kAll},
                       {"direftp", true, AdapterKind::kDireft, AdapterPositions::kPrompt}};

class AgreementTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AgreementTest, TrainerLogprobsEqualTheEnginesOnF32) {
  const std::string preset = GetParam();
  at::set_num_threads(2);
  const std::string dir = testing::TinyModel(preset, 21);
  auto engine_model = model::Model::Load(dir);
  ASSERT_TRUE(engine_model.ok()) << engine_model.status();
  auto tokenizer = text::Tokenizer::LoadFromModelDir(dir);
  ASSERT_TRUE(tokenizer.ok());
  auto torch_model = TorchModel::Load(dir, torch::kFloat32);
  ASSERT_TRUE(torch_model.ok()) << torch_model.status();
  const model::ModelConfig& config = (*engine_model)->config();

  // Random adapters as `preft make-adapter` writes them (non-zero updates).
  const std::string root = testing::TempDir("agreement_" + preset);
  adapters::RandomAdapterSpec lora;
  lora.rank = 8;
  lora.seed = 4;
  ASSERT_TRUE(adapters::WriteRandomAdapter(config, lora, root + "/lora").ok());
  adapters::RandomAdapterSpec direft;
  direft.kind = AdapterKind::kDireft;
  direft.rank = 4;
  direft.prompt_positions = "f2+l3";
  direft.layers = {0, 2};
  direft.seed = 5;
  ASSERT_TRUE(adapters::WriteRandomAdapter(config, direft, root + "/direft").ok());

  std::mt19937 rng(9);
  const int64_t lengths[] = {3, 17, 40};  // 40 crosses tiny-mistral's 32-token window
  double worst = 0;
  for (const Mode& mode : kModes) {
    std::shared_ptr<const model::AdapterWeights> weights;
    std::unique_ptr<TrainableAdapter> trainable;
    if (mode.adapter) {
      const std::string adir = root + (mode.kind == AdapterKind::kLora ? "/lora" : "/direft");
      auto w = adapters::LoadAdapter(adir, config);
      ASSERT_TRUE(w.ok()) << w.status();
      weights = std::move(w).value();
      auto t = TrainableAdapter::Load(adir, config, torch::kFloat32);
      ASSERT_TRUE(t.ok()) << t.status();
      trainable = std::move(t).value();
    }
    engine::EngineOptions options;
    options.kv_blocks = 64;
    auto engine = engine::Engine::Create(engine_model->get(), tokenizer->get(), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<engine::Request> requests;
    for (int64_t len : lengths) {
      engine::Request r;
      r.id = absl::StrCat(mode.name, "-", len);
      for (int64_t i = 0; i < len; ++i)
        r.prompt_ids.push_back(static_cast<int32_t>(rng() % config.vocab_size));
      r.sampling.max_tokens = 8;
      r.sampling.ignore_eos = true;
      r.sampling.logprobs = 0;
      if (mode.adapter) r.adapter = {weights, "a", 1, mode.positions};
      requests.push_back(std::move(r));
    }
    auto results = (*engine)->Generate(requests);
    ASSERT_TRUE(results.ok()) << results.status();

    std::vector<Example> examples;
    for (const engine::GenerationResult& r : *results) {
      ASSERT_TRUE(r.status.ok()) << r.status;
      ASSERT_EQ(r.token_ids.size(), 8u);
      examples.push_back({r.prompt_ids, r.token_ids, r.request_id});
    }
    std::vector<const Example*> batch;
    for (const Example& e : examples) batch.push_back(&e);
    AdapterMasking masking{mode.positions, trainable ? trainable->prompt_selection()
                                                     : model::PromptSelection{}};
    torch::NoGradGuard no_grad;
    const torch::Tensor got = CompletionLogprobs(
        **torch_model, trainable.get(), MakeExampleBatch(batch, masking, torch::kFloat32));
    int64_t n = 0;
    for (const engine::GenerationResult& r : *results) {
      for (size_t i = 0; i < r.logprobs.size(); ++i, ++n) {
        const double diff = std::abs(got[n].item<double>() - r.logprobs[i].logprob);
        worst = std::max(worst, diff);
        EXPECT_LT(diff, 1e-4) << preset << " " << mode.name << " " << r.request_id << " token "
                              << i;
      }
    }
    EXPECT_EQ(n, got.size(0));
  }
  std::printf("%s: max |trainer - engine| logprob over all modes: %.3g\n", preset.c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(Presets, AgreementTest,
                         ::testing::Values("tiny", "tiny-qwen2", "tiny-mistral"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace preft::train

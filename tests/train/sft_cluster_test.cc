// Learning is real, and what is trained is what is served: `preft train sft` (RunSft) teaches
// a tiny random model K prompt -> completion pairs with a LoRAP and a DiReFTP adapter; served
// prompt-only through a live cluster (router -> prefill with the adapter -> decode on the base
// model), each adapter gives the trained completion greedily for >= 90% of the prompts, the
// base model for none. Also: bad data writes nothing, and --resume replays exactly.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/cpp/preft_client.h"
#include "common/base/mapped_file.h"
#include "common/text/tokenizer.h"
#include "tests/train/train_test_util.h"
#include "tools/preft/embedded_cluster.h"
#include "train/sft_trainer.h"

namespace preft::train {
namespace {

client::ClientOptions ClientFor(const std::string& address) {
  client::ClientOptions o;
  o.address = address;
  return o;
}

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct Pair {
  std::string prompt, completion;
};

// K distinct questions, each with a random three-word answer.
std::vector<Pair> Pairs(int k, uint64_t seed) {
  const std::vector<std::string> words = {"red",  "blue",  "green", "quick", "lazy", "fox",
                                          "dog",  "cat",   "sun",   "moon",  "star", "river",
                                          "tree", "bird",  "fish",  "cloud", "rain", "snow"};
  std::mt19937 rng(seed);
  std::vector<Pair> out;
  for (int i = 0; i < k; ++i) {
    Pair p;
    p.prompt = absl::StrCat("Question ", i, ": what does the ", words[rng() % words.size()],
                            " say?");
    for (int w = 0; w < 3; ++w) {
      absl::StrAppend(&p.completion, w ? " " : "", words[rng() % words.size()]);
    }
    p.completion += ".";
    out.push_back(p);
  }
  return out;
}

std::string WriteJsonl(const std::string& path, const std::vector<Pair>& pairs) {
  std::ofstream f(path);
  for (const Pair& p : pairs) {
    f << nlohmann::json({{"prompt", p.prompt}, {"completion", p.completion}}).dump() << "\n";
  }
  return path;
}

SftOptions Options(const std::string& model, const std::string& data, const std::string& out) {
  SftOptions o;
  o.model_dir = model;
  o.data_path = data;
  o.out_dir = out;
  o.schedule = "constant";
  o.batch_tokens = 1024;
  o.threads = 2;
  o.seed = 1;
  return o;
}

TEST(SftClusterTest, TrainedPromptOnlyAdaptersReproduceTheirPairsThroughALiveCluster) {
  const std::string model = testing::TinyModel("tiny", 3);
  const std::string root = testing::TempDir("sft_cluster");
  const std::vector<Pair> pairs = Pairs(10, 2);
  const std::string data = WriteJsonl(root + "/train.jsonl", pairs);

  SftOptions lorap = Options(model, data, root + "/adapters/lorap");
  lorap.adapter.kind = model::AdapterKind::kLora;
  lorap.adapter.rank = 8;
  lorap.lr = 1e-2;
  lorap.steps = 150;
  auto r1 = RunSft(lorap, nullptr);
  ASSERT_TRUE(r1.ok()) << r1.status();
  SftOptions direftp = Options(model, data, root + "/adapters/direftp");
  direftp.adapter.kind = model::AdapterKind::kDireft;
  direftp.adapter.rank = 32;
  direftp.lr = 2e-2;
  direftp.steps = 300;
  auto r2 = RunSft(direftp, nullptr);
  ASSERT_TRUE(r2.ok()) << r2.status();
  std::printf("final loss: LoRAP %.4f, DiReFTP %.4f\n", r1->last_loss, r2->last_loss);

  tools::EmbeddedClusterOptions o;
  o.model_dir = model;
  o.adapter_root = root + "/adapters";
  o.threads = 1;
  auto cluster = tools::EmbeddedCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = client::Client::Connect(ClientFor((*cluster)->address()));
  ASSERT_TRUE(client.ok());
  for (const char* name : {"lorap", "direftp"}) {
    auto info = (*client)->RegisterAdapter(name, name);
    ASSERT_TRUE(info.ok()) << info.status();
  }
  for (const std::string name : {"", "lorap", "direftp"}) {
    int reproduced = 0;
    for (const Pair& p : pairs) {
      client::GenerateParams params;
      params.model = name;
      if (!name.empty()) params.positions = v1::ADAPTER_POSITIONS_PROMPT;
      params.max_tokens = 40;
      auto g = (*client)->Generate(client::Prompt::Text(p.prompt), params);
      ASSERT_TRUE(g.ok()) << g.status();
      if (!name.empty()) {
        EXPECT_EQ(g->finish.adapter(), name);
        EXPECT_EQ(g->finish.adapter_positions(), v1::ADAPTER_POSITIONS_PROMPT);
      }
      reproduced += g->text == p.completion;
    }
    const std::string label = name.empty() ? "base" : name;
    std::printf("%s: %d of %zu completions reproduced\n", label.c_str(), reproduced,
                pairs.size());
    if (name.empty()) {
      EXPECT_EQ(reproduced, 0);
    } else {
      EXPECT_GE(reproduced * 10, static_cast<int>(pairs.size()) * 9) << label;
    }
  }
  // The decode tier ran the base model only: in PreFT mode it has no adapter store at all.
  for (int i = 0; i < (*cluster)->num_decode(); ++i) {
    EXPECT_EQ((*cluster)->decode(i).adapter_store(), nullptr) << "decode " << i;
  }
}

TEST(SftTrainerTest, BadDataOrSpecWritesNothing) {
  const std::string model = testing::TinyModel("tiny", 3);
  const std::string root = testing::TempDir("sft_errors");
  const std::string bad = testing::WriteFile(
      root + "/bad.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n");
  SftOptions o = Options(model, bad, root + "/out");
  o.adapter.kind = model::AdapterKind::kLora;
  auto r = RunSft(o, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("bad.jsonl:2: "));
  EXPECT_FALSE(fs::exists(root + "/out"));

  o.data_path = WriteJsonl(root + "/good.jsonl", Pairs(2, 1));
  o.adapter.rank = 40;  // the tiny model's k_proj and v_proj are 32 wide
  r = RunSft(o, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("rank 40 is over the model's 32-wide"));
  o.adapter.rank = 8;
  o.adapter.layers = {7};
  r = RunSft(o, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("layer 7 is out of range"));
  EXPECT_FALSE(fs::exists(root + "/out"));
  o.adapter.layers = {};
  o.resume = true;
  r = RunSft(o, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SftTrainerTest, EvalLossFallsAsTrainingFitsTheSameDataAndIsLogged) {
  const std::string model = testing::TinyModel("tiny", 3);
  const std::string root = testing::TempDir("sft_eval");
  const std::string data = WriteJsonl(root + "/train.jsonl", Pairs(4, 6));
  SftOptions o = Options(model, data, root + "/out");
  o.adapter.kind = model::AdapterKind::kLora;
  o.eval_path = data;
  o.lr = 1e-2;
  o.steps = 1;
  auto first = RunSft(o, nullptr);
  ASSERT_TRUE(first.ok()) << first.status();
  o.steps = 40;
  o.eval_every = 20;
  auto r = RunSft(o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(first->eval_loss, 0);
  EXPECT_LT(r->eval_loss, first->eval_loss / 4);
  auto log = base::ReadFileToString(root + "/out/train_log.jsonl");
  ASSERT_TRUE(log.ok());
  int evals = 0, lines = 0;
  for (absl::string_view line : absl::StrSplit(*log, '\n', absl::SkipEmpty())) {
    const nlohmann::json j = nlohmann::json::parse(line);
    ++lines;
    if (j.contains("eval_loss")) ++evals;
  }
  EXPECT_EQ(lines, 40);
  EXPECT_EQ(evals, 2);  // steps 20 and 40
  // The adapter records where it applies: prompt-only by default.
  auto config = base::ReadFileToString(root + "/out/adapter_config.json");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(nlohmann::json::parse(*config)["preft_positions"], "prompt");
}

// Examples of very different lengths: each epoch's order packs them anew (the number of
// micro-batches may differ between epochs); eight epochs see every example eight times.
TEST(SftTrainerTest, EpochsThatPackDifferentlyAllRun) {
  const std::string model = testing::TinyModel("tiny", 3);
  const std::string root = testing::TempDir("sft_packing");
  std::vector<Pair> pairs = Pairs(30, 8);
  for (size_t i = 0; i < pairs.size(); ++i) {
    for (size_t k = 0; k < (i * 7) % 5; ++k) pairs[i].prompt += " and then some more words";
  }
  SftOptions o = Options(model, WriteJsonl(root + "/train.jsonl", pairs), root + "/out");
  o.adapter.kind = model::AdapterKind::kLora;
  o.adapter.rank = 2;
  o.batch_tokens = 300;
  o.epochs = 8;
  o.threads = 1;
  auto r = RunSft(o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  auto log = base::ReadFileToString(root + "/out/train_log.jsonl");
  ASSERT_TRUE(log.ok());
  int64_t lines = 0, tokens = 0;
  for (absl::string_view line : absl::StrSplit(*log, '\n', absl::SkipEmpty())) {
    ++lines;
    tokens += nlohmann::json::parse(line)["tokens"].get<int64_t>();
  }
  EXPECT_EQ(lines, r->steps);
  // Every epoch saw every example once: the tokens of 8 passes (the last step may reach a little
  // into a ninth).
  int64_t per_pass = 0;
  {
    auto tok = text::Tokenizer::LoadFromModelDir(model);
    ASSERT_TRUE(tok.ok());
    for (const Pair& p : pairs) {
      per_pass += static_cast<int64_t>((*tok)->Encode(p.prompt, true)->size() +
                                       (*tok)->Encode(p.completion, false)->size() + 1);
    }
  }
  EXPECT_GE(tokens, 8 * per_pass);
  EXPECT_LT(tokens, 9 * per_pass);
}

TEST(SftTrainerTest, ResumeFromACheckpointEndsWhereAnUnbrokenRunEnds) {
  const std::string model = testing::TinyModel("tiny", 3);
  const std::string root = testing::TempDir("sft_resume");
  const std::string data = WriteJsonl(root + "/train.jsonl", Pairs(6, 4));
  SftOptions o = Options(model, data, root + "/whole");
  o.adapter.kind = model::AdapterKind::kLora;
  o.adapter.rank = 4;
  o.lr = 5e-3;
  o.steps = 8;
  o.batch_tokens = 64;  // several micro-batches and epochs
  o.grad_accum = 2;
  o.warmup_steps = 2;
  o.threads = 1;
  ASSERT_TRUE(RunSft(o, nullptr).ok());

  SftOptions first = o;
  first.out_dir = root + "/split";
  first.steps = 8;
  first.save_every = 3;  // checkpoints at 3 and 6
  ASSERT_TRUE(RunSft(first, nullptr).ok());
  ASSERT_TRUE(fs::exists(root + "/split/checkpoints/step-6/optimizer.pt"));
  fs::remove(root + "/split/adapter_model.safetensors");
  SftOptions resumed = first;
  resumed.resume = true;
  auto r = RunSft(resumed, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->steps, 8);
  auto a = base::ReadFileToString(root + "/whole/adapter_model.safetensors");
  auto b = base::ReadFileToString(root + "/split/adapter_model.safetensors");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(*a == *b) << "the resumed adapter differs from the unbroken run's";

  SftOptions other = resumed;
  other.seed = 2;
  auto mismatch = RunSft(other, nullptr);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("other options"));
}

}  // namespace
}  // namespace preft::train

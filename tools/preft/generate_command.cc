#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "common/model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/preft/commands.h"

namespace preft::tools {
namespace {

struct GenerateFlags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int32_t max_tokens = 16;
  float temperature = 0.f;
  float top_p = 1.f;
  int32_t top_k = 0;
  float min_p = 0.f;
  int64_t seed = -1;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t logprobs = -1;
  bool json = false;
  int threads = 0;
  int64_t kv_mib = 1024;
};

int Fail(const std::string& message) {
  std::fprintf(stderr, "preft generate: %s\n", message.c_str());
  return 1;
}

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError("--prompt-ids: '" + std::string(part) +
                                        "' is not an integer");
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--prompt-ids: no ids given");
  return ids;
}

nlohmann::json ResultToJson(const engine::GenerationResult& r, bool with_logprobs) {
  nlohmann::json j;
  j["prompt_ids"] = r.prompt_ids;
  j["token_ids"] = r.token_ids;
  j["text"] = r.text;
  j["finish_reason"] = engine::FinishReasonName(r.finish);
  if (with_logprobs) {
    nlohmann::json steps = nlohmann::json::array();
    for (const engine::TokenLogprob& lp : r.logprobs) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& [id, v] : lp.top) top.push_back({id, v});
      steps.push_back({{"token_id", lp.token_id}, {"logprob", lp.logprob}, {"top", top}});
    }
    j["logprobs"] = steps;
  }
  return j;
}

int RunGenerate(const GenerateFlags& f) {
  auto model = model::Model::Load(f.model);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  std::unique_ptr<model::Tokenizer> tokenizer;
  auto tok = model::Tokenizer::LoadFromModelDir(f.model);
  if (tok.ok()) {
    tokenizer = std::move(tok).value();
  } else if (!f.prompt.empty()) {
    return Fail(std::string(tok.status().message()));
  }

  engine::Request req;
  req.id = "cli-0";
  if (!f.prompt_ids.empty()) {
    auto ids = ParseIds(f.prompt_ids);
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    req.prompt_ids = *ids;
  } else {
    auto ids = tokenizer->Encode(f.prompt, /*add_special_tokens=*/true);
    if (!ids.ok()) return Fail(std::string(ids.status().message()));
    req.prompt_ids = *ids;
  }
  engine::SamplingParams& sp = req.sampling;
  sp.temperature = f.temperature;
  sp.top_p = f.top_p;
  sp.top_k = f.top_k;
  sp.min_p = f.min_p;
  if (f.seed >= 0) sp.seed = static_cast<uint64_t>(f.seed);
  sp.max_tokens = f.max_tokens;
  sp.stop = f.stop;
  sp.stop_token_ids = f.stop_token_ids;
  sp.ignore_eos = f.ignore_eos;
  if (f.logprobs >= 0) sp.logprobs = f.logprobs;
  if (!f.json) {
    req.on_token = [](const engine::TokenEvent& e) {
      std::fwrite(e.text_delta.data(), 1, e.text_delta.size(), stdout);
      std::fflush(stdout);
    };
  }

  engine::EngineOptions options;
  options.kv_bytes = f.kv_mib << 20;
  options.num_threads = f.threads;
  auto eng = engine::Engine::Create(model->get(), tokenizer.get(), options);
  if (!eng.ok()) return Fail(std::string(eng.status().message()));
  const auto start = std::chrono::steady_clock::now();
  std::vector<engine::Request> reqs;
  reqs.push_back(std::move(req));
  auto results = (*eng)->Generate(std::move(reqs));
  if (!results.ok()) return Fail(std::string(results.status().message()));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const engine::GenerationResult& r = results->front();
  if (!r.status.ok()) return Fail(std::string(r.status.message()));
  if (f.json) {
    std::printf("%s\n", ResultToJson(r, f.logprobs >= 0).dump().c_str());
  } else {
    std::printf("\n");
    std::fflush(stdout);  // the text first, then the summary on stderr
    std::fprintf(stderr, "[%zu prompt tokens, %zu generated, %s, %.2f s]\n", r.prompt_ids.size(),
                 r.token_ids.size(), engine::FinishReasonName(r.finish), secs);
  }
  return 0;
}

}  // namespace

void RegisterGenerateCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("generate", "Generate from one prompt on a local model folder");
  auto f = std::make_shared<GenerateFlags>();
  cmd->add_option("--model", f->model, "Hugging Face model folder")->required();
  auto* prompt = cmd->add_option("--prompt", f->prompt, "Prompt text (tokenized with the model's tokenizer.json)");
  auto* ids = cmd->add_option("--prompt-ids", f->prompt_ids, "Prompt as comma-separated token ids");
  prompt->excludes(ids);
  cmd->add_option("--max-tokens", f->max_tokens, "Most tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "Sampling temperature; 0 is greedy")
      ->capture_default_str();
  cmd->add_option("--top-p", f->top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "Sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  cmd->add_option("--min-p", f->min_p, "Drop tokens below min-p times the best probability")
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Sampling seed (default: random)");
  cmd->add_option("--stop", f->stop, "Stop string (repeatable); the text ends before it");
  cmd->add_option("--stop-token-ids", f->stop_token_ids, "Token ids that end generation")
      ->delimiter(',');
  cmd->add_flag("--ignore-eos", f->ignore_eos, "Keep generating past end-of-sequence tokens");
  cmd->add_option("--logprobs", f->logprobs,
                  "Report each token's logprob and this many top alternatives (0-20)");
  cmd->add_flag("--json", f->json,
                "Print one JSON object: prompt_ids, token_ids, text, finish_reason[, logprobs]");
  cmd->add_option("--threads", f->threads, "Compute threads (default: all cores)");
  cmd->add_option("--kv-mib", f->kv_mib, "KV cache size in MiB")->capture_default_str();
  cmd->callback([f, exit_code, prompt, ids] {
    if (prompt->count() == 0 && ids->count() == 0) {
      std::fprintf(stderr, "preft generate: give --prompt or --prompt-ids\n");
      *exit_code = 2;
      return;
    }
    *exit_code = RunGenerate(*f);
  });
}

}  // namespace preft::tools

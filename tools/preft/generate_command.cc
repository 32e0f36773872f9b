#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/adapters/adapter_loader.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "common/serving/worker_setup.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
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
  std::string logprobs_mode = "raw";
  bool json = false;
  int threads = 0;
  int64_t kv_mib = 1024;
  std::vector<std::string> adapters;  // folders; "none" = base model
  std::string adapter_positions;      // "", "prompt" or "all"
  int concurrency = 1;
  bool chat = false;  // --prompt is a user message, rendered by the model's chat template
  std::string device = "cpu";  // or "cuda"
  std::string kv_dtype = "auto";
  int tensor_parallel = 1;      // GPUs the model is split over (cuda)
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
  if (!r.adapter.empty()) {
    j["adapter"] = r.adapter;
    j["adapter_positions"] = model::AdapterPositionsName(*r.adapter_positions);
  }
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
  std::unique_ptr<text::Tokenizer> tokenizer;
  auto tok = text::Tokenizer::LoadFromModelDir(f.model);
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
  } else if (f.chat) {
    // As /v1/chat/completions builds it: the template writes the special tokens.
    auto chat = text::ChatTemplate::FromModelDir(f.model);
    if (!chat.ok()) return Fail(std::string(chat.status().message()));
    auto rendered =
        chat->Render(text::jinja::Value::array({{{"role", "user"}, {"content", f.prompt}}}));
    if (!rendered.ok()) return Fail(std::string(rendered.status().message()));
    auto ids = tokenizer->Encode(*rendered, /*add_special_tokens=*/false);
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
  if (f.logprobs_mode == "processed") sp.logprobs_mode = engine::LogprobsMode::kProcessed;
  if (!f.json) {
    req.on_token = [](const engine::TokenEvent& e) {
      std::fwrite(e.text_delta.data(), 1, e.text_delta.size(), stdout);
      std::fflush(stdout);
    };
  }

  std::optional<model::AdapterPositions> positions;
  if (!f.adapter_positions.empty()) {
    model::AdapterPositions p;
    if (!model::ParseAdapterPositions(f.adapter_positions, &p)) {
      return Fail("--adapter-positions must be prompt or all, not '" + f.adapter_positions + "'");
    }
    positions = p;
  }
  std::vector<engine::RequestAdapter> adapters;
  adapters::LoadOptions load;
  load.dtype = f.device == "cuda" ? kernels::DType::kBF16 : (*model)->weight_dtype();
  load.cpu_layout = f.device != "cuda";
  for (const std::string& dir : f.adapters) {
    engine::RequestAdapter ra;
    if (dir != "none") {
      auto a = adapters::LoadAdapter(dir, (*model)->config(), load);
      if (!a.ok()) return Fail(std::string(a.status().message()));
      ra.weights = std::move(a).value();
      ra.name = dir;
      ra.version = 1;
      ra.positions = positions;
    }
    adapters.push_back(std::move(ra));
  }
  if (adapters.empty() && positions) return Fail("--adapter-positions needs --adapter");

  // --concurrency N runs N copies of the request in one batch, round-robin over the adapters.
  const int n = std::max(f.concurrency, static_cast<int>(adapters.size()));
  std::vector<engine::Request> reqs;
  for (int i = 0; i < n; ++i) {
    engine::Request r = req;
    r.id = "cli-" + std::to_string(i);
    if (!adapters.empty()) r.adapter = adapters[i % adapters.size()];
    if (i > 0) r.on_token = nullptr;  // stream the first request only
    reqs.push_back(std::move(r));
  }

  engine::EngineOptions options;
  // --kv-mib sizes the CPU's cache; a GPU's takes a share of its free memory.
  options.kv_bytes = f.device == "cpu" ? f.kv_mib << 20 : 0;
  options.num_threads = f.threads;
  absl::StatusOr<kv::KvDtype> kv_dtype =
      serving::ResolveKvDtype(f.kv_dtype, (*model)->weight_dtype());
  if (!kv_dtype.ok()) return Fail(std::string(kv_dtype.status().message()));
  options.kv_dtype = *kv_dtype;
  absl::StatusOr<std::unique_ptr<engine::Engine>> eng =
      serving::MakeEngine(model->get(), tokenizer.get(), f.device, options,
                          /*kv_transport=*/false, f.tensor_parallel);
  if (!eng.ok()) return Fail(std::string(eng.status().message()));
  const auto start = std::chrono::steady_clock::now();
  auto results = (*eng)->Generate(std::move(reqs));
  if (!results.ok()) return Fail(std::string(results.status().message()));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const engine::GenerationResult& r : *results) {
    if (!r.status.ok()) return Fail(std::string(r.status.message()));
  }
  const engine::GenerationResult& r = results->front();
  if (f.json) {
    // One object for one request (as before); one per line for --concurrency.
    for (const engine::GenerationResult& each : *results)
      std::printf("%s\n", ResultToJson(each, f.logprobs >= 0).dump().c_str());
  } else if (results->size() > 1) {
    std::printf("\n");
    size_t tokens = 0;
    for (const engine::GenerationResult& each : *results) tokens += each.token_ids.size();
    std::fflush(stdout);
    std::fprintf(stderr, "[%zu requests, %zu tokens generated, %.2f s, %.1f tok/s]\n",
                 results->size(), tokens, secs, tokens / secs);
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
  auto* prompt = cmd->add_option("--prompt", f->prompt,
                                 "Prompt text (tokenized with the model's tokenizer.json)");
  auto* ids = cmd->add_option("--prompt-ids", f->prompt_ids, "Prompt as comma-separated token ids");
  prompt->excludes(ids);
  cmd->add_flag("--chat", f->chat,
                "Treat --prompt as a user message and apply the model's chat template");
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
  cmd->add_option("--logprobs-mode", f->logprobs_mode,
                  "raw: the model's softmax; processed: the distribution the token was drawn "
                  "from (after temperature, top-k, top-p, min-p), as RL trainers need")
      ->check(CLI::IsMember({"raw", "processed"}))
      ->capture_default_str();
  cmd->add_flag("--json", f->json,
                "Print one JSON object: prompt_ids, token_ids, text, finish_reason[, logprobs]");
  cmd->add_option("--threads", f->threads, "Compute threads (default: all cores)");
  cmd->add_option("--kv-mib", f->kv_mib, "KV cache size in MiB (CPU)")->capture_default_str();
  serving::AddKvDtypeFlag(*cmd, &f->kv_dtype);
  cmd->add_option("--device", f->device,
                  "Where the forward runs: cpu, or cuda (the first GPU; KV cache sized from its "
                  "free memory)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--tensor-parallel", f->tensor_parallel,
                  "Split the model over this many GPUs (with --device cuda)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--adapter", f->adapters,
                  "Adapter folder (PEFT LoRA or DiReFT; repeatable, 'none' = base model)");
  cmd->add_option("--adapter-positions", f->adapter_positions,
                  "Apply adapters to prompt tokens only (LoRAP/DiReFTP) or all tokens; default: "
                  "the adapter's own preft_positions")
      ->check(CLI::IsMember({"prompt", "all"}));
  cmd->add_option("--concurrency", f->concurrency,
                  "Run this many copies of the request in one batch, round-robin over --adapter")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
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

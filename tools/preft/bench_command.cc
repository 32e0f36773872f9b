// `preft bench`: load against a running router, through the C++ SDK: N requests, closed loop at
// a given concurrency or Poisson arrivals at --rate (concurrency then caps requests in flight),
// prompt and output lengths fixed or uniform in a range (seeded), round-robin over adapters
// (PreFT or all-position), or lengths replayed from a JSONL file. Prompts may start with one
// shared system prompt (--shared-prefix-tokens) and requests may be conversations of several
// turns (--turns: each turn's prompt is the last one, its reply and a new message), to measure
// prefix caching. Prints throughput and latency percentiles (client-side: TTFT, inter-token
// latency, end to end; TTFT and prompt tokens cached per turn), as text or --json. Progress
// goes to stderr.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "clients/cpp/preft_client.h"
#include "nlohmann/json.hpp"
#include "tools/preft/commands.h"
#include "tools/preft/connection_flags.h"

namespace preft::tools {

namespace {

struct BenchFlags : ConnectionFlags {
  BenchFlags() { timeout_s = 300; }  // a request waits behind the whole load
  int requests = 64;
  int concurrency = 8;
  std::string prompt_tokens = "128";  // N, or LO:HI (uniform)
  std::string max_tokens = "64";
  std::string lengths_file;  // JSONL of {"prompt_tokens": N, "max_tokens": M}, replayed in order
  double rate = 0;  // requests/s, Poisson; 0: closed loop
  uint64_t seed = 1;
  std::string adapters = "none";  // comma-separated; "none" is the base model
  std::string positions = "prompt";
  int shared_prefix_tokens = 0;  // every prompt starts with the same tokens
  int turns = 1;                 // each request a conversation of this many turns
  bool json = false;
};

// "N" or "LO:HI" (inclusive, uniform).
absl::StatusOr<std::pair<int, int>> ParseRange(const std::string& flag, const std::string& v) {
  std::vector<std::string> parts = absl::StrSplit(v, ':');
  int lo = 0, hi = 0;
  if (parts.size() > 2 || !absl::SimpleAtoi(parts[0], &lo) ||
      !absl::SimpleAtoi(parts.back(), &hi) || lo < 1 || hi < lo) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " '", v, "' is not N or LO:HI with 1 <= LO <= HI"));
  }
  return std::make_pair(lo, hi);
}

// One {"prompt_tokens": N, "max_tokens": M} object per line (blank lines skipped), as a dataset's
// length distribution is usually shipped (e.g. ShareGPT's turns, tokenized). Errors name the line.
absl::StatusOr<std::vector<std::pair<int, int>>> ReadLengths(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--lengths: cannot open '", path, "'"));
  std::vector<std::pair<int, int>> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const auto field = [&](const char* key) -> int {
      if (!j.is_object() || !j.contains(key) || !j[key].is_number_integer()) return 0;
      const int64_t v = j[key].get<int64_t>();
      return v >= 1 && v <= (1 << 24) ? static_cast<int>(v) : 0;
    };
    const int prompt = field("prompt_tokens"), output = field("max_tokens");
    if (prompt == 0 || output == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lengths: ", path, ":", n,
          " is not {\"prompt_tokens\": N, \"max_tokens\": M} with positive integers"));
    }
    out.emplace_back(prompt, output);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--lengths: ", path, " is empty"));
  return out;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

int RunBench(const BenchFlags& f) {
  auto c = Connect(f);
  if (!c.ok()) return std::fprintf(stderr, "preft bench: %s\n", c.status().ToString().c_str()), 1;
  auto models = (*c)->ListModels();
  if (!models.ok()) {
    std::fprintf(stderr, "preft bench: %s\n", models.status().ToString().c_str());
    return 1;
  }
  const int32_t vocab = models->base().vocab_size();
  std::vector<std::string> adapters = absl::StrSplit(f.adapters, ',', absl::SkipEmpty());
  if (adapters.empty()) adapters.push_back("none");
  auto prompt_range = ParseRange("--prompt-tokens", f.prompt_tokens);
  auto output_range = ParseRange("--max-tokens", f.max_tokens);
  for (const auto* r : {&prompt_range, &output_range}) {
    if (!r->ok()) {
      std::fprintf(stderr, "preft bench: %s\n", std::string(r->status().message()).c_str());
      return 2;
    }
  }
  std::vector<std::pair<int, int>> replayed;
  if (!f.lengths_file.empty()) {
    auto l = ReadLengths(f.lengths_file);
    if (!l.ok()) return std::fprintf(stderr, "preft bench: %s\n", std::string(l.status().message()).c_str()), 2;
    replayed = *std::move(l);
  }
  // Every request's lengths and send time, drawn up front from the seed.
  std::mt19937_64 rng(f.seed);
  std::vector<int> prompt_len(f.requests), output_len(f.requests);
  std::vector<absl::Duration> send_at(f.requests);
  absl::Duration t;
  for (int i = 0; i < f.requests; ++i) {
    prompt_len[i] = std::uniform_int_distribution<int>(prompt_range->first, prompt_range->second)(rng);
    output_len[i] = std::uniform_int_distribution<int>(output_range->first, output_range->second)(rng);
    if (!replayed.empty()) std::tie(prompt_len[i], output_len[i]) = replayed[i % replayed.size()];
    if (f.rate > 0) t += absl::Seconds(std::exponential_distribution<double>(f.rate)(rng));
    send_at[i] = t;
  }
  int64_t requested = 0, requested_prompt = 0;
  for (int n : output_len) requested += int64_t{n} * f.turns;
  for (int n : prompt_len) requested_prompt += n;

  std::mutex mu;
  std::vector<double> ttft, itl, e2e;
  int64_t tokens = 0, failed = 0;
  std::vector<std::vector<double>> ttft_by_turn(f.turns);
  std::vector<int64_t> prompt_by_turn(f.turns), cached_by_turn(f.turns), turns_done(f.turns);
  std::string first_error;
  std::atomic<int> next{0}, done{0};
  const bool progress = isatty(STDERR_FILENO);
  const absl::Time start = absl::Now();
  auto worker = [&] {
    for (int i = next++; i < f.requests; i = next++) {
      const absl::Time due = start + send_at[i];
      if (absl::Now() < due) absl::SleepFor(due - absl::Now());
      client::GenerateParams p;  // the same for every turn of the conversation
      const std::string& a = adapters[i % adapters.size()];
      if (a != "none") p.model = a;
      p.positions = f.positions == "all" ? v1::ADAPTER_POSITIONS_ALL : v1::ADAPTER_POSITIONS_PROMPT;
      p.max_tokens = output_len[i];
      p.ignore_eos = true;
      std::vector<int32_t> prompt;
      for (int k = 0; k < f.shared_prefix_tokens; ++k) prompt.push_back((k * 97 + 3) % (vocab - 1));
      for (int turn = 0; turn < f.turns; ++turn) {
        // The user's message of this turn (after the conversation so far).
        for (int k = 0; k < prompt_len[i]; ++k) {
          prompt.push_back((k * 131 + i * 17 + turn * 7919) % (vocab - 1));
        }
        const absl::Time sent = absl::Now();
        absl::Time last = sent;
        std::vector<double> gaps;
        double first = -1;
        auto out = (*c)->Generate(client::Prompt::Ids(prompt), p, [&](const v1::GenerateResponse& d) {
          if (d.token_ids_size() == 0) return true;
          const absl::Time now = absl::Now();
          if (first < 0) {
            first = absl::ToDoubleMilliseconds(now - sent);
          } else {
            for (int k = 0; k < d.token_ids_size(); ++k) {
              gaps.push_back(absl::ToDoubleMilliseconds(now - last) / d.token_ids_size());
            }
          }
          last = now;
          return true;
        });
        std::lock_guard<std::mutex> lock(mu);
        if (!out.ok()) {
          ++failed;
          if (first_error.empty()) first_error = out.status().ToString();
          break;
        }
        ttft.push_back(first);
        itl.insert(itl.end(), gaps.begin(), gaps.end());
        e2e.push_back(absl::ToDoubleMilliseconds(absl::Now() - sent));
        tokens += static_cast<int64_t>(out->token_ids.size());
        ttft_by_turn[turn].push_back(first);
        prompt_by_turn[turn] += static_cast<int64_t>(prompt.size());
        cached_by_turn[turn] += out->finish.usage().cached_tokens();
        ++turns_done[turn];
        prompt.insert(prompt.end(), out->token_ids.begin(), out->token_ids.end());
      }
      const int n = ++done;
      if (progress) std::fprintf(stderr, "\rpreft bench: %d/%d requests", n, f.requests);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < f.concurrency; ++t) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  if (progress) std::fprintf(stderr, "\n");
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t cached = std::accumulate(cached_by_turn.begin(), cached_by_turn.end(), int64_t{0});
  nlohmann::json by_turn = nlohmann::json::array();
  for (int t = 0; t < f.turns; ++t) {
    const double n = std::max<int64_t>(1, turns_done[t]);
    by_turn.push_back({{"turn", t + 1},
                       {"ttft_ms_p50", Percentile(ttft_by_turn[t], 0.5)},
                       {"prompt_tokens", prompt_by_turn[t] / n},
                       {"cached_tokens", cached_by_turn[t] / n},
                       {"computed_prompt_tokens", (prompt_by_turn[t] - cached_by_turn[t]) / n}});
  }
  nlohmann::json r = {
      {"requests", f.requests},
      {"failed", failed},
      {"concurrency", f.concurrency},
      {"rate", f.rate},
      {"prompt_tokens", f.prompt_tokens},
      {"max_tokens", f.max_tokens},
      {"lengths_file", f.lengths_file},
      {"adapters", adapters.size()},
      {"requested_prompt_tokens", requested_prompt},
      {"requested_tokens", requested},
      {"generated_tokens", tokens},
      {"seconds", seconds},
      {"output_tokens_per_s", tokens / seconds},
      {"requests_per_s", (f.requests - failed) / seconds},
      {"ttft_ms", {{"p50", Percentile(ttft, 0.5)}, {"p90", Percentile(ttft, 0.9)}, {"p99", Percentile(ttft, 0.99)}}},
      {"itl_ms", {{"p50", Percentile(itl, 0.5)}, {"p90", Percentile(itl, 0.9)}, {"p99", Percentile(itl, 0.99)}}},
      {"e2e_ms", {{"p50", Percentile(e2e, 0.5)}, {"p90", Percentile(e2e, 0.9)}, {"p99", Percentile(e2e, 0.99)}}},
      {"shared_prefix_tokens", f.shared_prefix_tokens},
      {"turns", f.turns},
      {"cached_prompt_tokens", cached}};
  if (f.turns > 1) r["by_turn"] = by_turn;
  if (f.json) {
    std::printf("%s\n", r.dump().c_str());
  } else {
    std::printf("%d requests (%lld failed), %lld tokens in %.2f s: %.1f tok/s, %.2f req/s\n"
                "TTFT ms p50 %.1f p90 %.1f p99 %.1f | ITL ms p50 %.2f p99 %.2f | e2e ms p50 %.0f\n",
                f.requests, static_cast<long long>(failed), static_cast<long long>(tokens), seconds,
                tokens / seconds, (f.requests - failed) / seconds, Percentile(ttft, 0.5),
                Percentile(ttft, 0.9), Percentile(ttft, 0.99), Percentile(itl, 0.5),
                Percentile(itl, 0.99), Percentile(e2e, 0.5));
    if (cached > 0) std::printf("prompt tokens from prefix caches: %lld\n", static_cast<long long>(cached));
    for (int t = 0; f.turns > 1 && t < f.turns; ++t) {
      std::printf("turn %d: TTFT ms p50 %.1f, prompt %.0f tokens, %.0f cached\n", t + 1,
                  by_turn[t]["ttft_ms_p50"].get<double>(), by_turn[t]["prompt_tokens"].get<double>(),
                  by_turn[t]["cached_tokens"].get<double>());
    }
  }
  if (failed > 0) {
    std::fprintf(stderr, "preft bench: %lld requests failed; first: %s\n",
                 static_cast<long long>(failed), first_error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterBenchCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "load a running router: throughput and client-side TTFT / ITL percentiles");
  AddConnectionFlags(cmd, f.get());
  cmd->add_option("--requests", f->requests)->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--concurrency", f->concurrency)->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--prompt-tokens", f->prompt_tokens, "prompt length: N, or LO:HI uniform")
      ->capture_default_str();
  cmd->add_option("--max-tokens", f->max_tokens, "tokens to generate: N, or LO:HI uniform")
      ->capture_default_str();
  cmd->add_option("--lengths", f->lengths_file,
                  "JSONL of {\"prompt_tokens\": N, \"max_tokens\": M}, replayed in order "
                  "(cycled); overrides --prompt-tokens/--max-tokens");
  cmd->add_option("--rate", f->rate, "Poisson arrivals per second (0: closed loop)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "seed of lengths and arrivals")->capture_default_str();
  cmd->add_option("--adapters", f->adapters,
                  "comma-separated adapter names, round-robin; 'none' is the base model")
      ->capture_default_str();
  cmd->add_option("--adapter-positions", f->positions, "prompt (PreFT) or all")
      ->check(CLI::IsMember({"prompt", "all"}))
      ->capture_default_str();
  cmd->add_option("--shared-prefix-tokens", f->shared_prefix_tokens,
                  "every prompt starts with the same N tokens (a system prompt), then its own")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--turns", f->turns,
                  "each request is a conversation of N turns: a turn's prompt is the previous "
                  "prompt, its reply and a new message of --prompt-tokens")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_flag("--json", f->json, "one JSON object instead of text");
  cmd->callback([f, exit_code] { *exit_code = RunBench(*f); });
}

}  // namespace preft::tools

#include "train/reward.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unistd.h>

#include <cstdio>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace preft::train {
namespace {

std::string Normalize(std::string s) {
  s = std::string(absl::StripAsciiWhitespace(s));
  while (!s.empty() && s.back() == '.') s.pop_back();
  s = absl::StrReplaceAll(s, {{",", ""}, {"$", ""}});
  return std::string(absl::StripAsciiWhitespace(s));
}

class ExactReward final : public Reward {
 public:
  explicit ExactReward(std::string marker) : marker_(std::move(marker)) {}
  absl::StatusOr<std::vector<double>> Score(const std::vector<RewardInput>& batch) override {
    std::vector<double> out;
    for (const RewardInput& in : batch) {
      out.push_back(Normalize(ExtractAnswer(in.completion, marker_)) == Normalize(in.answer) ? 1
                                                                                           : 0);
    }
    return out;
  }
  bool needs_answer() const override { return true; }

 private:
  std::string marker_;
};

class RegexReward final : public Reward {
 public:
  static absl::StatusOr<std::unique_ptr<Reward>> Create(const std::string& pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      if (pcre2_get_error_message(error, message, sizeof(message)) < 0) message[0] = 0;
      return absl::InvalidArgumentError(absl::StrCat("--reward regex \"", pattern,
                                                     "\" does not compile at offset ", offset,
                                                     ": ", reinterpret_cast<char*>(message)));
    }
    return std::unique_ptr<Reward>(new RegexReward(code));
  }
  ~RegexReward() override {
    pcre2_match_data_free(match_);
    pcre2_code_free(code_);
  }
  absl::StatusOr<std::vector<double>> Score(const std::vector<RewardInput>& batch) override {
    std::vector<double> out;
    for (const RewardInput& in : batch) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(in.completion.data()),
                                 in.completion.size(), 0, 0, match_, nullptr);
      out.push_back(rc >= 0 ? 1 : 0);  // invalid UTF-8 in a completion simply does not match
    }
    return out;
  }

 private:
  explicit RegexReward(pcre2_code* code)
      : code_(code), match_(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  pcre2_code* code_;
  pcre2_match_data* match_;
};

class CommandReward final : public Reward {
 public:
  explicit CommandReward(std::string command) : command_(std::move(command)) {}
  absl::StatusOr<std::vector<double>> Score(const std::vector<RewardInput>& batch) override {
    char path[] = "/tmp/preft-reward-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return absl::InternalError("reward command: cannot create a temporary file");
    close(fd);
    {
      std::ofstream in(path);
      for (const RewardInput& r : batch) {
        in << nlohmann::json({{"prompt", r.prompt},
                              {"completion", r.completion},
                              {"answer", r.answer},
                              {"completion_ids", r.completion_ids}})
                  .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
           << "\n";
      }
    }
    const std::string shell = absl::StrCat("(", command_, ") < '", path, "'");
    std::FILE* pipe = popen(shell.c_str(), "r");
    if (pipe == nullptr) {
      std::remove(path);
      return absl::InternalError(absl::StrCat("reward command '", command_, "' cannot start"));
    }
    std::string output;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) output.append(buf, n);
    const int status = pclose(pipe);
    std::remove(path);
    if (status != 0) {
      return absl::InternalError(absl::StrCat("reward command '", command_, "' exited with status ",
                                              WEXITSTATUS(status)));
    }
    std::vector<double> out;
    int line = 0;
    for (absl::string_view l : absl::StrSplit(output, '\n', absl::SkipWhitespace())) {
      ++line;
      double v;
      if (!absl::SimpleAtod(absl::StripAsciiWhitespace(l), &v) || !std::isfinite(v)) {
        return absl::InternalError(absl::StrCat("reward command '", command_, "': output line ",
                                                line, " is not a finite number: \"",
                                                l.substr(0, 80), "\""));
      }
      out.push_back(v);
    }
    if (out.size() != batch.size()) {
      return absl::InternalError(absl::StrCat("reward command '", command_, "' printed ",
                                              out.size(), " scores for ", batch.size(),
                                              " rollouts"));
    }
    return out;
  }

 private:
  std::string command_;
};

}  // namespace

std::string ExtractAnswer(const std::string& completion, const std::string& marker) {
  if (!marker.empty()) {
    const size_t at = completion.rfind(marker);
    if (at != std::string::npos) {
      std::string rest = completion.substr(at + marker.size());
      const size_t newline = rest.find('\n', rest.find_first_not_of(" \t\n"));
      return newline == std::string::npos ? rest : rest.substr(0, newline);
    }
  }
  const size_t boxed = completion.rfind("\\boxed{");
  if (boxed != std::string::npos) {
    int depth = 1;
    const size_t start = boxed + 7;
    for (size_t i = start; i < completion.size(); ++i) {
      if (completion[i] == '{') ++depth;
      if (completion[i] == '}' && --depth == 0) return completion.substr(start, i - start);
    }
  }
  // The last number: digits with optional sign, commas and a decimal point.
  size_t end = completion.size();
  while (end > 0 && !absl::ascii_isdigit(static_cast<unsigned char>(completion[end - 1]))) --end;
  if (end == 0) return "";
  size_t begin = end;
  while (begin > 0) {
    const char c = completion[begin - 1];
    if (absl::ascii_isdigit(static_cast<unsigned char>(c)) || c == ',' || c == '.') {
      --begin;
    } else {
      break;
    }
  }
  if (begin > 0 && completion[begin - 1] == '-') --begin;
  return completion.substr(begin, end - begin);
}

absl::StatusOr<std::unique_ptr<Reward>> MakeReward(const std::string& spec,
                                                   const std::string& answer_marker) {
  if (spec == "exact") return std::unique_ptr<Reward>(new ExactReward(answer_marker));
  if (spec.rfind("regex:", 0) == 0) return RegexReward::Create(spec.substr(6));
  if (spec.rfind("command:", 0) == 0 && spec.size() > 8) {
    return std::unique_ptr<Reward>(new CommandReward(spec.substr(8)));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--reward must be exact, regex:PATTERN or command:PROG, got \"", spec, "\""));
}

}  // namespace preft::train

#pragma once

// Rewards for `preft train rl`, one score per rollout:
//  - "exact": the completion's final answer equals the prompt's "answer" (GSM8K / MATH style:
//    the text after the last answer marker, default "####"; without one, the last \boxed{...};
//    else the last number in the completion), compared after trimming spaces, a trailing
//    period, "$" and thousands commas. 1 or 0.
//  - "regex:PATTERN": 1 when PATTERN (PCRE2, Python re syntax for what rewards use) matches
//    anywhere in the completion, else 0.
//  - "command:PROG": runs PROG (through /bin/sh) once per batch with one JSON object per
//    rollout on stdin ({"prompt", "completion", "answer", "completion_ids"}) and reads one
//    number per line from its stdout: any verifier plugs in.
// Torch-free.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace preft::train {

struct RewardInput {
  std::string prompt;      // the prompt's text (for chat prompts: the rendered conversation)
  std::string completion;  // the generated text
  std::string answer;      // the prompt's "answer" field ("" when absent)
  std::vector<int32_t> completion_ids;
};

class Reward {
 public:
  virtual ~Reward() = default;
  // One score per input, in order. Errors: a command that fails or answers badly (Internal,
  // with what it printed).
  virtual absl::StatusOr<std::vector<double>> Score(const std::vector<RewardInput>& batch) = 0;
  // Whether prompts must carry an "answer".
  virtual bool needs_answer() const { return false; }
};

// "exact", "regex:PATTERN" or "command:PROG"; InvalidArgument for anything else or a pattern
// that does not compile.
absl::StatusOr<std::unique_ptr<Reward>> MakeReward(const std::string& spec,
                                                   const std::string& answer_marker = "####");

// The final answer `exact` reads from a completion (exposed for tests).
std::string ExtractAnswer(const std::string& completion, const std::string& marker);

}  // namespace preft::train

#pragma once

// One training sequence: a prompt (the tokens an adapter adapts under PreFT) and the completion
// the model should produce after it. SFT reads them from JSONL; RL builds them from rollouts.

#include <cstdint>
#include <string>
#include <vector>

namespace preft::train {

struct Example {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> completion_ids;
  std::string source;  // where it came from, for messages: "train.jsonl:12" or a rollout id

  int64_t num_tokens() const {
    return static_cast<int64_t>(prompt_ids.size() + completion_ids.size());
  }
};

}  // namespace preft::train

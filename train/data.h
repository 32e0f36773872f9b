#pragma once

// Reads training data. SFT data in TRL's two JSONL formats and tokenizes it exactly as the server will see it:
//  - {"prompt": "...", "completion": "..."}: the prompt encoded with special tokens (as
//    /v1/completions and `preft generate --prompt` do), the completion without, then EOS;
//    TRL's conversational variant ({"prompt": [messages], "completion": [messages]}) is
//    rendered like "messages" below.
//  - {"messages": [{"role", "content"}, ...]}: rendered with the model's chat template. Each
//    assistant turn becomes one example whose prompt is everything before it rendered with
//    add_generation_prompt (as /v1/chat/completions builds it) and whose completion is the
//    rest of the conversation's rendering up to the end of that turn. Under PreFT an earlier
//    assistant turn is prompt (adapted) when a later one is generated, so it is trained as
//    prompt too (docs/TRAINING.md).
// Torch-free.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "train/example.h"

namespace preft::train {

struct SftDataOptions {
  int64_t max_length = 2048;  // prompt + completion tokens; longer examples are errors
  bool append_eos = true;     // end prompt/completion examples' completions with EOS (TRL)
  int64_t vocab_size = 0;     // ids must be below it (0: unchecked)
};

// Every example of the JSONL file at `path`. `chat` may be null (a model without a chat
// template): "messages" lines are then an error. Errors are InvalidArgument (NotFound for a
// missing file) and start with "path:line: " (malformed JSON, a missing or mistyped field, an
// unknown role, a conversation without an assistant turn, an empty completion, an example over
// max_length); an empty file is an error too.
absl::StatusOr<std::vector<Example>> ReadSftData(const std::string& path,
                                                 const text::Tokenizer& tokenizer,
                                                 const text::ChatTemplate* chat,
                                                 const SftDataOptions& options);

// An RL prompt: {"prompt": "text", "answer": ...} (encoded with special tokens) or
// {"messages": [...], "answer": ...} (rendered with the chat template and a generation prompt,
// as /v1/chat/completions does). "answer" (a string or a number) is what `exact` compares to.
struct RlPrompt {
  std::vector<int32_t> prompt_ids;
  std::string text;    // the prompt text the reward sees (rendered, for messages)
  std::string answer;  // "" when absent
  std::string source;  // "path:line"
};

// Every prompt of the JSONL file at `path`; errors as ReadSftData's ("path:line: ..."), and
// a missing "answer" when `need_answer`.
absl::StatusOr<std::vector<RlPrompt>> ReadRlPrompts(const std::string& path,
                                                    const text::Tokenizer& tokenizer,
                                                    const text::ChatTemplate* chat,
                                                    const SftDataOptions& options,
                                                    bool need_answer);

}  // namespace preft::train

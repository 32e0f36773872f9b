#pragma once

// Hugging Face tokenizer.json: byte-level BPE as used by Llama 3 and Qwen2/2.5.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace preft::text {

// Immutable after Load; Encode/Decode are thread-safe.
class Tokenizer {
 public:
  // Reads `tokenizer_json_path`; also reads tokenizer_config.json beside it when present
  // (add_bos_token, bos/eos tokens). Unsupported model types or pre-tokenizers are refused
  // with a message naming them.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& tokenizer_json_path);
  // Loads `<dir>/tokenizer.json`.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> LoadFromModelDir(const std::string& dir);

  virtual ~Tokenizer() = default;

  // Text to ids. Special/added tokens in the text are matched as whole tokens. Prepends BOS when
  // `add_special_tokens` and the tokenizer config says add_bos_token. Invalid UTF-8 input gives
  // InvalidArgument naming the byte offset.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                      bool add_special_tokens = true) const = 0;
  // Ids to text (bytes of invalid sequences become U+FFFD). `skip_special_tokens` drops added
  // special tokens. Out-of-range ids give InvalidArgument.
  virtual absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                             bool skip_special_tokens = false) const = 0;
  // Raw bytes of one token (byte-level decoded), empty for unknown ids.
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;

  virtual int32_t vocab_size() const = 0;  // highest id + 1, added tokens included
  virtual int32_t bos_token_id() const = 0;  // -1 if none
  virtual int32_t eos_token_id() const = 0;  // -1 if none
  // Id of an exact token string (vocab or added), or -1.
  virtual int32_t TokenToId(std::string_view token) const = 0;
};

// Turns a stream of token ids into text pieces that never split a UTF-8 code point: bytes of
// an incomplete sequence are held until it completes (or flushed as U+FFFD when invalid).
// Not thread-safe; one per request.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer* tokenizer, bool skip_special_tokens = false)
      : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}
  // Text that became complete with this token (possibly empty).
  std::string Push(int32_t id);
  // Whatever is still held, with invalid/incomplete bytes as U+FFFD.
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

// Options for a synthetic byte-level BPE tokenizer of a given vocabulary size, used by
// make-model: 256 byte tokens, deterministic merges, then special tokens at the top ids.
struct SyntheticTokenizerOptions {
  int32_t vocab_size = 0;
  // "llama3" (Llama 3 split regex, <|begin_of_text|>/<|end_of_text|>...) or
  // "qwen2" (Qwen2 split regex, <|endoftext|>, <|im_start|>, <|im_end|>).
  std::string style = "llama3";
  std::string chat_template;  // written as tokenizer_config.json's chat_template unless empty
};

// Writes tokenizer.json and tokenizer_config.json into `dir`. Returns the ids of BOS (or -1)
// and EOS chosen, via `bos_id`/`eos_id`.
absl::Status WriteSyntheticTokenizer(const std::string& dir, const SyntheticTokenizerOptions& o,
                                     int32_t* bos_id, int32_t* eos_id);

}  // namespace preft::text

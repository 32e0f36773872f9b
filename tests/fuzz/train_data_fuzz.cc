// libFuzzer target: the trainer's JSONL readers (ReadSftData, ReadRlPrompts) on arbitrary bytes
// must return a Status, never crash or hang; every example they accept fits what the trainer
// assumes (a non-empty prompt and completion, within max_length, ids in the vocabulary).

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "train/data.h"

namespace {

struct Fixture {
  std::unique_ptr<preft::text::Tokenizer> tokenizer;
  std::unique_ptr<preft::text::ChatTemplate> chat;
  std::string path = "/tmp/preft_train_data_fuzz_" + std::to_string(getpid()) + ".jsonl";
};

const Fixture& Get() {
  static Fixture* f = [] {
    auto* f = new Fixture;
    // make-model's qwen2 tokenizer (byte-level BPE, Qwen2's NFC normalizer), written once.
    const std::string dir = "/tmp/preft_train_data_fuzz_tokenizer_" + std::to_string(getpid());
    std::filesystem::create_directories(dir);
    preft::text::SyntheticTokenizerOptions options;
    options.vocab_size = 512;
    options.style = "qwen2";
    int32_t bos = -1, eos = -1;
    if (!preft::text::WriteSyntheticTokenizer(dir, options, &bos, &eos).ok()) std::abort();
    auto tok = preft::text::Tokenizer::LoadFromModelDir(dir);
    if (!tok.ok()) std::abort();
    f->tokenizer = std::move(tok).value();
    auto chat = preft::text::ChatTemplate::Create(preft::text::BuiltinChatTemplate("llama3"),
                                                   "<|begin_of_text|>", "<|end_of_text|>");
    if (!chat.ok()) std::abort();
    f->chat = std::make_unique<preft::text::ChatTemplate>(*std::move(chat));
    return f;
  }();
  return *f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& f = Get();
  {
    std::ofstream out(f.path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  preft::train::SftDataOptions o;
  o.max_length = 256;
  o.vocab_size = 260;  // below the tokenizer's 512: some ids must be refused
  auto examples = preft::train::ReadSftData(f.path, *f.tokenizer, f.chat.get(), o);
  if (examples.ok()) {
    for (const preft::train::Example& e : *examples) {
      if (e.prompt_ids.empty() || e.completion_ids.empty() || e.num_tokens() > o.max_length) {
        std::abort();
      }
      for (const auto* ids : {&e.prompt_ids, &e.completion_ids})
        for (int32_t id : *ids)
          if (id < 0 || id >= o.vocab_size) std::abort();
    }
  }
  auto prompts = preft::train::ReadRlPrompts(f.path, *f.tokenizer, f.chat.get(), o, false);
  if (prompts.ok()) {
    for (const preft::train::RlPrompt& p : *prompts) {
      if (p.prompt_ids.empty() || static_cast<int64_t>(p.prompt_ids.size()) >= o.max_length) {
        std::abort();
      }
    }
  }
  return 0;
}

// `preft tokenize`: a model folder's tokenizer on text, as the servers tokenize prompts (the
// tokenizer.json's normalizer, pre-tokenizer and added tokens; BOS unless --no-special).

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/preft/commands.h"

namespace preft::tools {

void RegisterTokenizeCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "tokenize", "Token ids of text: --text, or with --jsonl one JSON string per stdin line");
  struct Flags {
    std::string model, text;
    bool jsonl = false, no_special = false;
  };
  auto f = std::make_shared<Flags>();
  cmd->add_option("--model", f->model, "Model folder (tokenizer.json)")->required();
  auto* text = cmd->add_option("--text", f->text, "Text to tokenize");
  cmd->add_flag("--jsonl", f->jsonl,
                "Read a JSON string per line from stdin, print a JSON list of ids per line")
      ->excludes(text);
  cmd->add_flag("--no-special", f->no_special, "Add no special tokens (BOS)");
  cmd->callback([f, exit_code] {
    auto fail = [exit_code](const std::string& message) {
      std::fprintf(stderr, "preft tokenize: %s\n", message.c_str());
      *exit_code = 1;
    };
    auto tok = text::Tokenizer::LoadFromModelDir(f->model);
    if (!tok.ok()) return fail(std::string(tok.status().message()));
    auto encode = [&](const std::string& s) -> bool {
      auto ids = (*tok)->Encode(s, !f->no_special);
      if (!ids.ok()) {
        fail(std::string(ids.status().message()));
        return false;
      }
      std::printf("%s\n", nlohmann::json(*ids).dump().c_str());
      return true;
    };
    if (!f->jsonl) {
      encode(f->text);
      return;
    }
    std::string line;
    for (int n = 1; std::getline(std::cin, line); ++n) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_string()) return fail("stdin line " + std::to_string(n) + " is not a JSON string");
      if (!encode(j.get<std::string>())) return;
    }
  });
}

}  // namespace preft::tools

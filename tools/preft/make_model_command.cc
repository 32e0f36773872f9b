#include <cstdio>
#include <string>

#include "absl/strings/str_join.h"
#include "common/model/make_model.h"
#include "tools/preft/commands.h"

namespace preft::tools {

void RegisterMakeModelCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "make-model", "Write a Hugging Face model folder with random weights in a preset's shapes");
  struct Flags {
    std::string preset = "tiny";
    std::string dtype = "f32";
    uint64_t seed = 0;
    std::string out;
  };
  auto flags = std::make_shared<Flags>();
  cmd->add_option("--preset", flags->preset,
                  "Shape preset: " + absl::StrJoin(model::PresetNames(), ", "))
      ->capture_default_str();
  cmd->add_option("--dtype", flags->dtype, "Weight dtype: f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "Seed of the random weights")->capture_default_str();
  cmd->add_option("--out", flags->out, "Output folder (created if missing)")->required();
  cmd->callback([flags, exit_code] {
    model::MakeModelOptions o;
    o.preset = flags->preset;
    o.dtype = flags->dtype == "bf16" ? kernels::DType::kBF16 : kernels::DType::kF32;
    o.seed = flags->seed;
    o.out_dir = flags->out;
    absl::Status s = model::MakeModel(o);
    if (!s.ok()) {
      std::fprintf(stderr, "preft make-model: %s\n", std::string(s.message()).c_str());
      *exit_code = 1;
      return;
    }
    std::fprintf(stderr, "preft make-model: wrote %s (%s, %s)\n", o.out_dir.c_str(),
                 o.preset.c_str(), flags->dtype.c_str());
  });
}

}  // namespace preft::tools

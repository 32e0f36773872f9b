#include <unistd.h>

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
    bool kv_scales = false;
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
  cmd->add_flag("--kv-scales", flags->kv_scales,
                "Also write fp8 KV scales (self_attn.k_scale and v_scale per layer), as "
                "KV-quantised checkpoints carry them; --kv-dtype fp8_e4m3 reads them");
  cmd->callback([flags, exit_code] {
    model::MakeModelOptions o;
    o.preset = flags->preset;
    o.dtype = flags->dtype == "bf16" ? kernels::DType::kBF16 : kernels::DType::kF32;
    o.seed = flags->seed;
    o.out_dir = flags->out;
    o.kv_scales = flags->kv_scales;
    // Large presets take minutes: a progress line on a terminal (whole percents only).
    if (isatty(STDERR_FILENO)) {
      o.progress = [last = -1](int64_t done, int64_t total) mutable {
        const int pct = total > 0 ? static_cast<int>(100 * done / total) : 100;
        if (pct == last) return;
        last = pct;
        std::fprintf(stderr, "\rpreft make-model: writing weights %3d%%", pct);
        if (done == total) std::fprintf(stderr, "\n");
      };
    }
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

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/adapters/make_adapter.h"
#include "common/model/config.h"
#include "tools/preft/adapter_flags.h"
#include "tools/preft/commands.h"

namespace preft::tools {

void RegisterMakeAdapterCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("make-adapter",
                                 "Write a random LoRA (PEFT) or DiReFT adapter folder for a model");
  struct Flags {
    std::string model;
    std::string kind;
    int64_t rank = 8;
    double alpha = 16;
    bool rslora = false;
    std::string targets = "q,k,v,o,gate,up,down";
    std::string layers = "all";
    std::string prompt_positions = "all";
    std::string positions;
    std::string dtype = "f32";
    uint64_t seed = 0;
    bool zero_update = false;
    std::string out;
  };
  auto flags = std::make_shared<Flags>();
  cmd->add_option("--model", flags->model, "Base model folder (its config.json sets the shapes)")
      ->required();
  cmd->add_option("--kind", flags->kind, "Adapter kind: lora or direft")
      ->required()
      ->check(CLI::IsMember({"lora", "direft"}));
  cmd->add_option("--rank", flags->rank, "Rank r")->capture_default_str();
  cmd->add_option("--alpha", flags->alpha, "LoRA alpha (scale alpha/r)")->capture_default_str();
  cmd->add_flag("--rslora", flags->rslora, "LoRA: rank-stabilised scale alpha/sqrt(r)");
  cmd->add_option("--targets", flags->targets, "LoRA projections: q,k,v,o,gate,up,down or all")
      ->capture_default_str();
  cmd->add_option("--layers", flags->layers, "Adapted layers: all or a list such as 0,2,5")
      ->capture_default_str();
  cmd->add_option("--prompt-positions", flags->prompt_positions,
                  "DiReFT: intervened prompt tokens, all or pyreft's fN+lM")
      ->capture_default_str();
  cmd->add_option("--positions", flags->positions,
                  "Default positions written as preft_positions: prompt or all (unset: none)")
      ->check(CLI::IsMember({"prompt", "all"}));
  cmd->add_option("--dtype", flags->dtype, "Weight dtype: f32, bf16 or f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "Seed of the random weights")->required();
  cmd->add_flag("--zero-update", flags->zero_update,
                "LoRA B / DiReFT W2 and b1 zero: the adapter starts as the base model (as "
                "training starts; an RL starting point)");
  cmd->add_option("--out", flags->out, "Output folder (created if missing)")->required();
  cmd->callback([flags, exit_code] {
    auto fail = [exit_code](const absl::Status& s) {
      std::fprintf(stderr, "preft make-adapter: %s\n", std::string(s.message()).c_str());
      *exit_code = 1;
    };
    absl::StatusOr<model::ModelConfig> base =
        model::ModelConfig::FromFile(flags->model + "/config.json");
    if (!base.ok()) return fail(base.status());
    adapters::RandomAdapterSpec spec;
    spec.kind = flags->kind == "lora" ? model::AdapterKind::kLora : model::AdapterKind::kDireft;
    spec.rank = flags->rank;
    spec.alpha = flags->alpha;
    spec.use_rslora = flags->rslora;
    if (absl::Status s = ParseTargets(flags->targets, &spec.targets); !s.ok()) return fail(s);
    if (absl::Status s = ParseLayers(flags->layers, &spec.layers); !s.ok()) return fail(s);
    spec.prompt_positions = flags->prompt_positions;
    if (!flags->positions.empty()) {
      model::AdapterPositions p;
      model::ParseAdapterPositions(flags->positions, &p);  // checked by IsMember
      spec.preft_positions = p;
    }
    spec.dtype = flags->dtype == "bf16"  ? kernels::DType::kBF16
                 : flags->dtype == "f16" ? kernels::DType::kF16
                                         : kernels::DType::kF32;
    spec.seed = flags->seed;
    spec.zero_update = flags->zero_update;
    spec.base_model_name_or_path = flags->model;
    if (absl::Status s = adapters::WriteRandomAdapter(*base, spec, flags->out); !s.ok()) {
      return fail(s);
    }
    std::fprintf(stderr, "preft make-adapter: wrote %s (%s, rank %lld, %s)\n", flags->out.c_str(),
                 flags->kind.c_str(), static_cast<long long>(flags->rank), flags->dtype.c_str());
  });
}

}  // namespace preft::tools

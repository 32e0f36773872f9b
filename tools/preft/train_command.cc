// `preft train sft`: fine-tune a LoRA / DiReFT adapter, prompt-only (LoRAP / DiReFTP) by
// default, into a folder the server loads. `preft train rl`: on-policy RL of a registered
// adapter against a running cluster (docs/TRAINING.md).

#include <cstdio>
#include <memory>
#include <string>

#include "tools/preft/adapter_flags.h"
#include "tools/preft/commands.h"
#include "tools/preft/connection_flags.h"
#include "train/rl_trainer.h"
#include "train/sft_trainer.h"

namespace preft::tools {
namespace {

void RegisterSft(CLI::App& train, int* exit_code) {
  auto* cmd = train.add_subcommand(
      "sft", "Supervised fine-tuning of an adapter on TRL-style JSONL (prompt/completion or "
             "messages); loss on completion tokens only");
  struct Flags {
    train::SftOptions o;
    std::string kind;
    std::string positions = "prompt";
    std::string targets = "q,k,v,o,gate,up,down";
    std::string layers = "all";
  };
  auto f = std::make_shared<Flags>();
  train::SftOptions& o = f->o;
  cmd->add_option("--model", o.model_dir, "Base model folder (Hugging Face)")->required();
  cmd->add_option("--data", o.data_path, "Training JSONL")->required();
  cmd->add_option("--eval", o.eval_path, "Evaluation JSONL (loss reported)");
  cmd->add_option("--out", o.out_dir, "Adapter folder to write (created if missing)")->required();
  auto* kind = cmd->add_option("--kind", f->kind, "Adapter kind: lora or direft")
                   ->check(CLI::IsMember({"lora", "direft"}));
  cmd->add_option("--init", o.init_dir,
                  "Continue from this adapter folder (its kind, rank, targets, layers)")
      ->excludes(kind);
  cmd->add_option("--positions", f->positions,
                  "Where the adapter applies, in training and (as preft_positions) in serving: "
                  "prompt (LoRAP / DiReFTP) or all")
      ->check(CLI::IsMember({"prompt", "all"}))
      ->capture_default_str();
  cmd->add_option("--rank", o.adapter.rank, "Rank r")->capture_default_str();
  cmd->add_option("--alpha", o.adapter.alpha, "LoRA alpha (scale alpha/r)")->capture_default_str();
  cmd->add_flag("--rslora", o.adapter.use_rslora, "LoRA: rank-stabilised scale alpha/sqrt(r)");
  cmd->add_option("--targets", f->targets, "LoRA projections: q,k,v,o,gate,up,down or all")
      ->capture_default_str();
  cmd->add_option("--layers", f->layers, "Adapted layers: all or a list such as 0,2,5")
      ->capture_default_str();
  cmd->add_option("--prompt-positions", o.adapter.prompt_positions,
                  "DiReFT: intervened prompt tokens, all or pyreft's fN+lM")
      ->capture_default_str();
  cmd->add_option("--lr", o.lr, "Peak learning rate (AdamW)")->capture_default_str();
  cmd->add_option("--schedule", o.schedule, "After warm-up: linear (decay to 0) or constant")
      ->check(CLI::IsMember({"linear", "constant"}))
      ->capture_default_str();
  cmd->add_option("--warmup-steps", o.warmup_steps, "Linear warm-up steps")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--max-grad-norm", o.max_grad_norm, "Gradient clipping (0: off)")
      ->capture_default_str();
  auto* epochs = cmd->add_option("--epochs", o.epochs, "Passes over the data")
                     ->check(CLI::PositiveNumber)
                     ->capture_default_str();
  cmd->add_option("--steps", o.steps, "Optimizer steps (overrides --epochs)")
      ->check(CLI::PositiveNumber)
      ->excludes(epochs);
  cmd->add_option("--batch-tokens", o.batch_tokens,
                  "Padded tokens per micro-batch (at least one example)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--grad-accum", o.grad_accum, "Micro-batches per optimizer step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-length", o.max_length, "Longest example (prompt + completion tokens)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("!--no-eos", o.append_eos,
                "Do not end prompt/completion examples with the EOS token");
  cmd->add_option("--seed", o.seed, "Seed of the adapter's init and the data order")
      ->capture_default_str();
  cmd->add_option("--log-every", o.log_every, "Steps between progress lines")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--eval-every", o.eval_every, "Steps between evaluations (0: at the end)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--save-every", o.save_every,
                  "Steps between checkpoints (adapter + optimizer state; 0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_flag("--resume", o.resume, "Continue from the newest checkpoint in --out");
  cmd->add_option("--threads", o.threads, "Compute threads (default: all cores)");
  cmd->add_option("--max-rank", o.max_rank, "Highest rank the servers accept (their --max-rank)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->callback([f, exit_code] {
    auto fail = [exit_code](const absl::Status& s) {
      std::fprintf(stderr, "preft train sft: %s\n", std::string(s.message()).c_str());
      *exit_code = 1;
    };
    train::SftOptions o = f->o;
    if (f->kind.empty() && o.init_dir.empty()) {
      std::fprintf(stderr, "preft train sft: give --kind (lora or direft) or --init\n");
      *exit_code = 2;
      return;
    }
    o.adapter.kind = f->kind == "lora" ? model::AdapterKind::kLora : model::AdapterKind::kDireft;
    model::ParseAdapterPositions(f->positions, &o.positions);  // checked by IsMember
    if (absl::Status s = ParseTargets(f->targets, &o.adapter.targets); !s.ok()) return fail(s);
    if (absl::Status s = ParseLayers(f->layers, &o.adapter.layers); !s.ok()) return fail(s);
    o.adapter.base_model_name_or_path = o.model_dir;
    absl::StatusOr<train::SftResult> r = train::RunSft(o, stderr);
    if (!r.ok()) return fail(r.status());
  });
}

void RegisterRl(CLI::App& train, int* exit_code) {
  auto* cmd = train.add_subcommand(
      "rl", "On-policy RL (GRPO-style) of a registered adapter against a running cluster; "
            "weight sync through UpdateAdapter touches the prefill tier only");
  struct Flags {
    train::RlOptions o;
    ConnectionFlags connection;
    std::string kind = "lora";
    std::string positions = "prompt";
    std::string targets = "q,k,v,o,gate,up,down";
    std::string layers = "all";
    bool dr_grpo = false;
  };
  auto f = std::make_shared<Flags>();
  train::RlOptions& o = f->o;
  AddConnectionFlags(cmd, &f->connection);
  cmd->add_option("--router", f->connection.server, "The router's address (as --server)");
  cmd->add_option("--adapter", o.adapter, "The registered adapter to train")->required();
  cmd->add_option("--model", o.model_dir, "The base model folder (the trainer's copy)")
      ->required();
  cmd->add_option("--prompts", o.prompts_path,
                  "JSONL: {\"prompt\": ..., \"answer\": ...} or {\"messages\": [...], ...}")
      ->required();
  cmd->add_option("--reward", o.reward, "exact, regex:PATTERN or command:PROG")
      ->capture_default_str();
  cmd->add_option("--answer-marker", o.answer_marker, "exact: the answer follows the last one")
      ->capture_default_str();
  cmd->add_option("--out", o.out_dir, "Folder for rl_log.jsonl, policy/ and the final adapter")
      ->required();
  cmd->add_option("--init", o.init_dir,
                  "The registered version's adapter folder (default: a fresh zero-update "
                  "adapter of --kind/--rank..., pushed first)");
  cmd->add_option("--kind", f->kind, "Fresh adapter: lora or direft")
      ->check(CLI::IsMember({"lora", "direft"}))
      ->capture_default_str();
  cmd->add_option("--rank", o.spec.rank, "Fresh adapter: rank")->capture_default_str();
  cmd->add_option("--alpha", o.spec.alpha, "Fresh LoRA: alpha")->capture_default_str();
  cmd->add_flag("--rslora", o.spec.use_rslora, "Fresh LoRA: alpha/sqrt(r)");
  cmd->add_option("--targets", f->targets, "Fresh LoRA: projections")->capture_default_str();
  cmd->add_option("--layers", f->layers, "Fresh adapter: layers")->capture_default_str();
  cmd->add_option("--prompt-positions", o.spec.prompt_positions, "Fresh DiReFT: fN+lM")
      ->capture_default_str();
  cmd->add_option("--positions", f->positions, "Where the adapter applies: prompt or all")
      ->check(CLI::IsMember({"prompt", "all"}))
      ->capture_default_str();
  cmd->add_option("--group", o.group, "Samples per prompt (G)")->capture_default_str();
  cmd->add_option("--batch", o.batch, "Prompts per iteration (B)")->capture_default_str();
  cmd->add_option("--iterations", o.iterations, "Iterations")->capture_default_str();
  cmd->add_option("--updates-per-iteration", o.updates_per_iteration,
                  "Optimizer steps per batch of rollouts")
      ->capture_default_str();
  cmd->add_option("--temperature", o.temperature, "Rollout temperature")->capture_default_str();
  cmd->add_option("--max-tokens", o.max_tokens, "Most tokens per rollout")->capture_default_str();
  cmd->add_option("--lr", o.lr, "Learning rate (AdamW)")->capture_default_str();
  cmd->add_option("--clip", o.clip, "Clipped-ratio epsilon")->capture_default_str();
  cmd->add_option("--beta", o.beta, "KL coefficient to the starting adapter")
      ->capture_default_str();
  cmd->add_flag("--dr-grpo", f->dr_grpo, "Advantages r - mean (no division by the std)");
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--max-grad-norm", o.max_grad_norm, "Gradient clipping (0: off)")
      ->capture_default_str();
  cmd->add_option("--batch-tokens", o.batch_tokens, "Padded tokens per micro-batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of the rollouts and the prompt order")
      ->capture_default_str();
  cmd->add_option("--concurrency", o.concurrency, "Rollout requests in flight")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Trainer compute threads (default: all cores)");
  cmd->callback([f, exit_code] {
    auto fail = [exit_code](const absl::Status& s) {
      std::fprintf(stderr, "preft train rl: %s\n", std::string(s.message()).c_str());
      *exit_code = 1;
    };
    train::RlOptions o = f->o;
    absl::StatusOr<client::ClientOptions> server = ClientOptionsFrom(f->connection);
    if (!server.ok()) return fail(server.status());
    o.server = *server;
    o.spec.kind = f->kind == "lora" ? model::AdapterKind::kLora : model::AdapterKind::kDireft;
    model::ParseAdapterPositions(f->positions, &o.positions);  // checked by IsMember
    o.scale_by_std = !f->dr_grpo;
    if (absl::Status s = ParseTargets(f->targets, &o.spec.targets); !s.ok()) return fail(s);
    if (absl::Status s = ParseLayers(f->layers, &o.spec.layers); !s.ok()) return fail(s);
    o.spec.base_model_name_or_path = o.model_dir;
    absl::StatusOr<train::RlResult> r = train::RunRl(o, stderr);
    if (!r.ok()) return fail(r.status());
  });
}

}  // namespace

void RegisterTrainCommand(CLI::App& app, int* exit_code) {
  auto* train = app.add_subcommand("train", "Train prefill-only adapters (docs/TRAINING.md)");
  train->require_subcommand(1);
  RegisterSft(*train, exit_code);
  RegisterRl(*train, exit_code);
}

}  // namespace preft::tools

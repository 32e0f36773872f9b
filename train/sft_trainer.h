#pragma once

// `preft train sft`: supervised fine-tuning of a LoRA / DiReFT adapter on a frozen base, with
// the adapter applied where the server will apply it (prompt tokens only for LoRAP / DiReFTP).
// Torch-free interface; the loop runs on libtorch inside the trainer's library.

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "common/adapters/adapter_writer.h"
#include "common/model/adapter_weights.h"

namespace preft::train {

struct SftOptions {
  std::string model_dir;
  std::string data_path;   // TRL JSONL (train/data.h)
  std::string eval_path;   // optional
  std::string out_dir;     // the adapter folder; also train_log.jsonl and checkpoints/
  // kind, rank, alpha, use_rslora, targets, layers, prompt_positions (DiReFT's fN+lM);
  // preft_positions is set from `positions`.
  adapters::AdapterSpec adapter;
  model::AdapterPositions positions = model::AdapterPositions::kPrompt;
  // Start from this adapter folder (its kind, rank, targets and layers; `adapter` is then
  // ignored) instead of a fresh zero-update one: continued training, a next version.
  std::string init_dir;

  double lr = 1e-4;
  std::string schedule = "linear";  // or "constant"; after warmup_steps of linear warm-up
  int64_t warmup_steps = 0;
  double weight_decay = 0.0;        // AdamW's
  double max_grad_norm = 1.0;       // 0: no clipping
  int64_t epochs = 1;
  int64_t steps = 0;                // > 0 overrides epochs
  int64_t batch_tokens = 4096;      // padded tokens per micro-batch (at least one example)
  int64_t grad_accum = 1;           // micro-batches per optimizer step
  int64_t max_length = 2048;        // longer examples are errors
  bool append_eos = true;
  uint64_t seed = 0;                // adapter init and data order
  int64_t log_every = 1;
  int64_t eval_every = 0;           // 0: only at the end (when eval_path is set)
  int64_t save_every = 0;           // checkpoints (adapter + optimizer state); 0: none
  bool resume = false;              // continue from the newest checkpoint in out_dir
  int threads = 0;                  // 0: every core
  int64_t max_rank = 128;           // the servers' --max-rank
};

struct SftResult {
  int64_t steps = 0;
  double last_loss = 0;       // mean token loss of the last step
  double eval_loss = -1;      // mean token loss on eval_path after training; -1 without
  double tokens_per_s = 0;    // prompt + completion tokens (no padding) per second
  int64_t examples = 0;
};

// Validates everything (data, spec, rank, out_dir) before writing anything; then trains,
// reporting progress on `progress` (may be null) and as JSON lines in out_dir/train_log.jsonl,
// and writes the adapter folder atomically. Errors: InvalidArgument (bad data, naming file and
// line; a rank or layer the model cannot take), NotFound (missing files), FailedPrecondition
// (--resume without a checkpoint, or with other options than the checkpoint's).
absl::StatusOr<SftResult> RunSft(const SftOptions& options, std::FILE* progress);

}  // namespace preft::train

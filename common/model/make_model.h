#pragma once

// `preft make-model`: writes a complete Hugging Face model folder with random weights in the
// exact shapes of a preset, so tests, demos and benchmarks need no downloads.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kernels/dtype.h"
#include "common/model/checkpoint.h"
#include "common/model/config.h"

namespace preft::model {

// Presets: "tiny" (Llama, GQA, llama3 rope scaling), "tiny-qwen2" (QKV bias, tied
// embeddings), "tiny-mistral", and the real shapes "qwen2.5-0.5b", "llama3.2-1b",
// "llama3.1-8b".
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);
std::vector<std::string> PresetNames();

struct MakeModelOptions {
  std::string preset = "tiny";
  kernels::DType dtype = kernels::DType::kF32;  // f32 or bf16
  uint64_t seed = 0;
  std::string out_dir;
  // Shard size: weights over this are split into model-0000k-of-0000n.safetensors + index.
  int64_t max_shard_bytes = int64_t{5} << 30;
  // Also write each layer's fp8 KV scales, as KV-quantised checkpoints carry them:
  // self_attn.k_scale (one per layer, shape []) and self_attn.v_scale (one per KV head).
  bool kv_scales = false;
  // Called after each tensor is written with the weight bytes written so far and in all
  // (the CLI's progress line); may be empty.
  std::function<void(int64_t done, int64_t total)> progress;
};

// The standard deviation make-model draws a (non-norm) tensor with: fan-in scaled
// (1/sqrt(in)), 2.5/sqrt(hidden) for embeddings and LM head, 0.1 for biases.
double InitStd(const ExpectedTensor& tensor);

// Writes config.json, generation_config.json, model.safetensors (or shards + index),
// tokenizer.json and tokenizer_config.json into out_dir (created if missing).
// Deterministic for a given (preset, dtype, seed).
absl::Status MakeModel(const MakeModelOptions& options);

}  // namespace preft::model

#pragma once

// Reads adapter folders from disk and validates them against a base model:
//  - LoRA: Hugging Face PEFT (`adapter_config.json` + `adapter_model.safetensors`, legacy
//    `adapter_model.bin` refused with a message), r / lora_alpha / target_modules (list or
//    regex) / use_rslora / rank_pattern / alpha_pattern / fan_in_fan_out / bias "none".
//  - DiReFT: `adapter_config.json` with "peft_type": "DIREFT" and per-layer
//    `layers.{i}.direft.{learned_source.weight, learned_source.bias, proj_layer.weight}`.
// Formats are documented in docs/ADAPTERS.md. Unsupported features are refused with an error
// that names them; an adapter for another base model fails here, never at forward time.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/kernels/dtype.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::adapters {

struct LoadOptions {
  int64_t max_rank = 128;                       // ranks above are refused
  kernels::DType dtype = kernels::DType::kF32;  // matrices are converted to this dtype
  // For the CPU kernels: matrices they can take chunked (kernels::cpu::LowRankChunkable) are
  // stored so, for a faster multi-LoRA decode. Not for adapters a GPU backend uploads.
  bool cpu_layout = false;
  // The adapter root, for folders a client named: the folder must lie under it, and it and
  // its files are opened beneath it following no symbolic link (base::OpenBeneath), so nothing
  // resolves outside the root even when links or renames race the load. "" (local use, e.g.
  // `preft generate --adapter`): the folder as given, links followed (a Hugging Face cache's
  // snapshot folders are links to its blobs).
  std::string confine_to;
};

// Loads the adapter in `dir` for a model with config `base`. Errors name the file and the
// problem: InvalidArgument for bad or mismatched content, NotFound for missing files,
// Unimplemented for features preft does not serve (DoRA, modules_to_save, ...).
absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadAdapter(const std::string& dir,
                                                                   const model::ModelConfig& base,
                                                                   const LoadOptions& options = {});

}  // namespace preft::adapters

#pragma once

// A Hugging Face model folder's weights: model.safetensors, or shards listed in
// model.safetensors.index.json ("weight_map": {tensor: shard file}).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"

namespace preft::model {

// A weight a model of some config must have, in Hugging Face naming.
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
  bool is_norm = false;  // RMSNorm weight (initialised to 1 by make-model)
  bool is_bias = false;
  bool is_kv_scale = false;  // optional self_attn.{k,v}_scale of fp8 KV (make-model --kv-scales)
};

// Every weight of a Llama/Qwen2/Mistral model with `config`, in module order (embeddings, layers,
// final norm, lm_head unless tied). Llama with attention_bias also has o_proj.bias, as in HF.
std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config);

// Owns the mapped shard files; tensors borrow them. Immutable after Open; thread-safe to read.
class Checkpoint {
 public:
  // Opens `dir`: the index (if present) and every shard it names, else model.safetensors.
  // Errors name the file and the problem (missing shard, tensor listed in the index but absent
  // from its shard, ...).
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // The tensor `name` if it exists with exactly `shape`; otherwise NotFound / InvalidArgument
  // naming the tensor, the file, and the expected vs actual shape.
  absl::StatusOr<const TensorInfo*> Get(std::string_view name,
                                        const std::vector<int64_t>& shape) const;
  bool Has(std::string_view name) const;
  // Get() for every ExpectedTensors(config); the first missing or misshapen one is the error.
  absl::Status CheckTensors(const ModelConfig& config) const;
  const std::map<std::string, const TensorInfo*, std::less<>>& tensors() const { return tensors_; }
  const std::string& dir() const { return dir_; }
  // Bytes of all mapped shards, and how many of them sit in huge pages.
  size_t total_bytes() const;
  size_t huge_page_bytes() const;

 private:
  Checkpoint() = default;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> tensors_;
};

}  // namespace preft::model

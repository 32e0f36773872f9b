#pragma once

// A Hugging Face model folder's weights: model.safetensors, or shards listed in
// model.safetensors.index.json ("weight_map": {tensor: shard file}).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/safetensors.h"

namespace preft::model {

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
  const std::map<std::string, const TensorInfo*, std::less<>>& tensors() const { return tensors_; }
  const std::string& dir() const { return dir_; }
  // Bytes of all mapped shards.
  size_t total_bytes() const;

 private:
  Checkpoint() = default;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> tensors_;
};

}  // namespace preft::model

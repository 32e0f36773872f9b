#pragma once

// Flags that describe an adapter's shape, shared by `preft make-adapter` and `preft train`.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model/adapter_weights.h"

namespace preft::tools {

// --targets: "all" or a comma list of q,k,v,o,gate,up,down (or q_proj, ...).
absl::Status ParseTargets(const std::string& text, std::vector<model::Projection>* out);
// --layers: "all" (an empty list) or a comma list of layer indices.
absl::Status ParseLayers(const std::string& text, std::vector<int64_t>* out);

}  // namespace preft::tools

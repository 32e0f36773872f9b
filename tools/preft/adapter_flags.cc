#include "tools/preft/adapter_flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace preft::tools {

absl::Status ParseTargets(const std::string& text, std::vector<model::Projection>* out) {
  out->clear();
  if (text == "all") {
    for (int p = 0; p < model::kNumProjections; ++p) {
      out->push_back(static_cast<model::Projection>(p));
    }
    return absl::OkStatus();
  }
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    bool found = false;
    for (int p = 0; p < model::kNumProjections; ++p) {
      const std::string name = model::ProjectionName(static_cast<model::Projection>(p));
      // "q" or "q_proj"
      if (part == name || absl::StrCat(part, "_proj") == name) {
        out->push_back(static_cast<model::Projection>(p));
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat("--targets: unknown projection '", part,
                                                     "' (use q,k,v,o,gate,up,down or all)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseLayers(const std::string& text, std::vector<int64_t>* out) {
  out->clear();
  if (text == "all") return absl::OkStatus();
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t layer = 0;
    if (!absl::SimpleAtoi(part, &layer)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layers: '", part, "' is not a layer index (use all or e.g. 0,2,5)"));
    }
    out->push_back(layer);
  }
  return absl::OkStatus();
}

}  // namespace preft::tools

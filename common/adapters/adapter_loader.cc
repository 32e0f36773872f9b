#include "common/adapters/adapter_loader.h"

#include <exception>
#include <filesystem>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "common/adapters/loader_util.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/safetensors.h"

namespace preft::adapters {
namespace {

using internal::ConfigReader;
using internal::Json;

// adapter_config.json is flat apart from rank_pattern / alpha_pattern; deeper is hostile input
// (and nlohmann's parser recurses).
constexpr int kMaxJsonDepth = 8;

absl::StatusOr<Json> ParseJson(const std::string& text, const std::string& path) {
  try {
    Json::parser_callback_t limit_depth = [](int depth, Json::parse_event_t, Json&) {
      if (depth > kMaxJsonDepth) throw std::length_error("JSON nested too deeply");
      return true;
    };
    return Json::parse(text, limit_depth);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
}

bool IsFile(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}

}  // namespace

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadAdapter(const std::string& dir,
                                                                   const model::ModelConfig& base,
                                                                   const LoadOptions& options) {
  const std::filesystem::path root(dir);
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": adapter folder not found"));
  }
  if (options.max_rank < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadOptions.max_rank must be >= 1, got ", options.max_rank));
  }
  const std::string config_path = (root / internal::kConfigFile).string();
  if (!IsFile(config_path)) {
    return absl::NotFoundError(absl::StrCat(config_path, ": not found (an adapter folder holds ",
                                            internal::kConfigFile, " and ", internal::kWeightsFile,
                                            ")"));
  }
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(config_path));
  PREFT_ASSIGN_OR_RETURN(Json j, ParseJson(text, config_path));
  ConfigReader config(j, config_path);
  if (!j.is_object()) return config.Invalid("top level must be a JSON object");

  PREFT_ASSIGN_OR_RETURN(std::string peft_type, config.String("peft_type", ""));
  if (peft_type.empty()) {
    return config.Invalid("missing \"peft_type\" (expected \"LORA\" or \"DIREFT\")");
  }
  if (peft_type != "LORA" && peft_type != "DIREFT") {
    return config.Unimplemented(
        absl::StrCat("peft_type \"", peft_type, "\" is not supported (supported: LORA, DIREFT)"));
  }

  const std::string weights_path = (root / internal::kWeightsFile).string();
  if (!IsFile(weights_path)) {
    if (IsFile(root / "adapter_model.bin")) {
      return absl::UnimplementedError(absl::StrCat(
          (root / "adapter_model.bin").string(),
          ": pickled PyTorch weights are not read (they can run code); convert to safetensors, "
          "e.g. save_pretrained(..., safe_serialization=True)"));
    }
    return absl::NotFoundError(absl::StrCat(weights_path, ": not found"));
  }
  // Read, not mapped: every tensor is copied into the adapter's own storage once.
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<model::SafetensorsFile> weights,
                         model::SafetensorsFile::Read(weights_path));

  if (peft_type == "LORA") return internal::LoadLora(config, *weights, base, options);
  return internal::LoadDireft(config, *weights, base, options);
}

}  // namespace preft::adapters

#include "common/adapters/adapter_loader.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "common/adapters/loader_util.h"
#include "common/base/confined_open.h"
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

// The adapter folder, opened once; its files are opened from the descriptor, so the folder
// read is the folder checked.
class AdapterFolder {
 public:
  static absl::StatusOr<AdapterFolder> Open(const std::string& dir, const std::string& root) {
    if (root.empty()) {
      const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd < 0) return absl::NotFoundError(absl::StrCat(dir, ": adapter folder not found"));
      return AdapterFolder(dir, base::Fd(fd), false);
    }
    std::error_code ec;
    const std::string canonical_root = std::filesystem::canonical(root, ec).string();
    if (ec) return absl::NotFoundError(absl::StrCat("adapter root '", root, "': ", ec.message()));
    const std::string prefix = canonical_root + "/";
    if (dir.compare(0, prefix.size(), prefix) != 0 || dir.size() == prefix.size()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": outside the adapter root"));
    }
    PREFT_ASSIGN_OR_RETURN(base::Fd root_fd, base::OpenFolder(canonical_root));
    absl::StatusOr<base::Fd> folder =
        base::OpenBeneath(root_fd.get(), dir.substr(prefix.size()), base::OpenKind::kFolder);
    if (absl::IsNotFound(folder.status())) {
      return absl::NotFoundError(absl::StrCat(dir, ": adapter folder not found"));
    }
    if (!folder.ok()) return Named(folder.status(), canonical_root);
    return AdapterFolder(dir, *std::move(folder), true);
  }

  // `name` in the folder: a regular file (beneath it, no link followed, when confined).
  absl::StatusOr<base::Fd> OpenFile(const char* name) const {
    if (confined_) {
      absl::StatusOr<base::Fd> fd = base::OpenBeneath(fd_.get(), name, base::OpenKind::kRegularFile);
      if (!fd.ok()) return Named(fd.status(), dir_);
      return fd;
    }
    const int fd = ::openat(fd_.get(), name, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      return absl::Status(errno == ENOENT ? absl::StatusCode::kNotFound
                                          : absl::StatusCode::kInvalidArgument,
                          absl::StrCat(Path(name), ": cannot open: ", std::strerror(errno)));
    }
    return base::Fd(fd);
  }

  std::string Path(const char* name) const { return absl::StrCat(dir_, "/", name); }

 private:
  AdapterFolder(std::string dir, base::Fd fd, bool confined)
      : dir_(std::move(dir)), fd_(std::move(fd)), confined_(confined) {}

  // OpenBeneath names paths relative to where it started: say where that is.
  static absl::Status Named(const absl::Status& s, const std::string& under) {
    return absl::Status(s.code(), absl::StrCat(under, "/", s.message()));
  }

  std::string dir_;
  base::Fd fd_;
  bool confined_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<model::AdapterWeights>> LoadAdapter(const std::string& dir,
                                                                   const model::ModelConfig& base,
                                                                   const LoadOptions& options) {
  if (options.max_rank < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadOptions.max_rank must be >= 1, got ", options.max_rank));
  }
  PREFT_ASSIGN_OR_RETURN(const AdapterFolder folder, AdapterFolder::Open(dir, options.confine_to));
  const std::string config_path = folder.Path(internal::kConfigFile);
  absl::StatusOr<base::Fd> config_fd = folder.OpenFile(internal::kConfigFile);
  if (absl::IsNotFound(config_fd.status())) {
    return absl::NotFoundError(absl::StrCat(config_path, ": not found (an adapter folder holds ",
                                            internal::kConfigFile, " and ", internal::kWeightsFile,
                                            ")"));
  }
  if (!config_fd.ok()) return config_fd.status();
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadOpenedToString(config_fd->get(), config_path));
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

  const std::string weights_path = folder.Path(internal::kWeightsFile);
  absl::StatusOr<base::Fd> weights_fd = folder.OpenFile(internal::kWeightsFile);
  if (absl::IsNotFound(weights_fd.status())) {
    if (!absl::IsNotFound(folder.OpenFile("adapter_model.bin").status())) {
      return absl::UnimplementedError(absl::StrCat(
          folder.Path("adapter_model.bin"),
          ": pickled PyTorch weights are not read (they can run code); convert to safetensors, "
          "e.g. save_pretrained(..., safe_serialization=True)"));
    }
    return absl::NotFoundError(absl::StrCat(weights_path, ": not found"));
  }
  if (!weights_fd.ok()) return weights_fd.status();
  // Read, not mapped: every tensor is copied into the adapter's own storage once.
  PREFT_ASSIGN_OR_RETURN(std::unique_ptr<model::SafetensorsFile> weights,
                         model::SafetensorsFile::ReadOpened(weights_fd->get(), weights_path));

  if (peft_type == "LORA") return internal::LoadLora(config, *weights, base, options);
  return internal::LoadDireft(config, *weights, base, options);
}

}  // namespace preft::adapters

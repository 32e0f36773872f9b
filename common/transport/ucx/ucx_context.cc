#include "common/transport/ucx/ucx_context.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace preft::transport {
namespace {

// What a UCX print function writes to a FILE*, as a string.
template <typename Print>
std::string Capture(Print print) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&buffer, &size);
  if (stream == nullptr) return "";
  print(stream);
  std::fclose(stream);
  std::string out(buffer, size);
  std::free(buffer);
  return out;
}

// Whether the transports UCX may open include shared memory (posix, sysv): UCX_TLS lists names
// and aliases ("sm", "shm"), or is "all", or excludes some ("^tcp").
bool MayUseSharedMemory(const UcxTransportOptions& options) {
  const char* env = std::getenv("UCX_TLS");
  const std::string tls = !options.tls.empty() ? options.tls : env != nullptr ? env : "all";
  for (absl::string_view name : absl::StrSplit(tls, ',')) {
    if (name.empty()) continue;
    if (name[0] == '^' || name == "all" || name == "sm" || name == "shm" || name == "posix" ||
        name == "sysv" || name == "mm") {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status UcxError(const char* what, ucs_status_t status) {
  return absl::UnavailableError(absl::StrCat("UCX ", what, ": ", ucs_status_string(status)));
}

absl::StatusOr<ucp_context_h> CreateUcpContext(const UcxTransportOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcxError("ucp_config_read", st);
  std::vector<std::pair<const char*, std::string>> settings;
  if (!options.tls.empty()) settings.emplace_back("TLS", options.tls);
  if (!options.net_devices.empty()) settings.emplace_back("NET_DEVICES", options.net_devices);
  if (options.shm_error_handling && MayUseSharedMemory(options) &&
      std::getenv("UCX_POSIX_ERROR_HANDLING") == nullptr &&
      std::getenv("UCX_SYSV_ERROR_HANDLING") == nullptr &&
      std::getenv("UCX_MM_ERROR_HANDLING") == nullptr) {
    // Without it, shared memory offers no peer failure handling and an endpoint that asks for
    // it finds no transport ("no active messages transport ... no peer failure handler").
    // ucp_config_modify reaches transport settings only under the shared-memory family's
    // prefix: "POSIX_ERROR_HANDLING" is refused at worker creation, "MM_..." covers posix and
    // sysv.
    settings.emplace_back("MM_ERROR_HANDLING", "y");
  }
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    if (MayUseSharedMemory(options)) {
      // UCX 1.13's keepalive dereferences a null endpoint after a shared-memory connect to a
      // peer that has died (openucx/ucx#8511: "mm ep failed to connect to remote FIFO", then
      // SIGSEGV in ucp_ep_do_uct_ep_am_keepalive): a decode worker crashed when a prefill
      // worker was killed. Off for shared memory; dead peers still fail transfers through
      // MM_ERROR_HANDLING and the transfer timeout.
      settings.emplace_back("KEEPALIVE_INTERVAL", "inf");
    } else if (options.keepalive_interval > absl::ZeroDuration()) {
      settings.emplace_back(
          "KEEPALIVE_INTERVAL",
          absl::StrCat(absl::ToInt64Milliseconds(options.keepalive_interval), "ms"));
    }
  }
  for (const auto& [name, value] : settings) {
    st = ucp_config_modify(config, name, value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("UCX: cannot set UCX_", name, "=", value, ": ", ucs_status_string(st)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) return UcxError("ucp_init", st);
  return context;
}

std::vector<std::string> ContextTransports(ucp_context_h context) {
  // ucp_context_print_info lists "resource N : md M dev D flags -- tl/device" lines.
  const std::string info = Capture([&](FILE* f) { ucp_context_print_info(context, f); });
  std::vector<std::string> names;
  bool self = false;
  for (absl::string_view line : absl::StrSplit(info, '\n')) {
    if (line.find("resource") == absl::string_view::npos) continue;
    const size_t dashes = line.find("-- ");
    if (dashes == absl::string_view::npos) continue;
    absl::string_view tl = line.substr(dashes + 3);
    tl = tl.substr(0, tl.find('/'));
    if (tl == "self") {
      self = true;
    } else if (std::find(names.begin(), names.end(), tl) == names.end()) {
      names.emplace_back(tl);
    }
  }
  if (self) names.push_back("self");
  return names;
}

std::string EndpointLanes(ucp_ep_h ep) {
  const std::string info = Capture([&](FILE* f) { ucp_ep_print_info(ep, f); });
  std::vector<std::string> lanes;
  for (absl::string_view line : absl::StrSplit(info, '\n')) {
    const size_t at = line.find("lane[");
    if (at == absl::string_view::npos) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line.substr(at), ' ', absl::SkipWhitespace());
    lanes.push_back(absl::StrJoin(words, " "));
  }
  return absl::StrJoin(lanes, " | ");
}

}  // namespace preft::transport

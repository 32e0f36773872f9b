#include "services/router/access.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/fnv.h"
#include "common/base/mapped_file.h"

namespace preft::router {

namespace {

// Same time for any mismatch position (the length is not secret).
bool SameToken(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// The bearer token of an `authorization` value, or "" when it carries none.
std::string BearerToken(absl::string_view value) {
  constexpr absl::string_view kBearer = "Bearer ";
  if (value.size() <= kBearer.size() || !absl::StartsWithIgnoreCase(value, kBearer)) return "";
  return std::string(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
}

std::string Metadata(const grpc::ServerContextBase& context, const char* key) {
  const auto& md = context.client_metadata();
  auto it = md.find(key);
  return it == md.end() ? "" : std::string(it->second.data(), it->second.size());
}

}  // namespace

Caller CallerOf(const grpc::ServerContextBase& context) {
  Caller c;
  c.authorization = Metadata(context, "authorization");
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    for (const grpc::string_ref& id : auth->GetPeerIdentity()) {
      c.tls_identity.assign(id.data(), id.size());
      break;
    }
  }
  // "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000": the address without the port.
  const std::string peer = context.peer();
  const size_t colon = peer.rfind(':');
  c.address = colon == std::string::npos ? peer : peer.substr(0, colon);
  return c;
}

absl::Status Access::Authorize(const grpc::ServerContextBase& context, Scope scope) const {
  Caller caller;
  caller.authorization = Metadata(context, "authorization");
  return Authorize(caller, scope);
}

absl::Status Access::Authorize(const Caller& caller, Scope scope) const {
  const std::string& admin = options_.admin_token;
  const std::string& api = options_.api_token;
  const bool needed = scope == Scope::kAdmin ? !admin.empty() : !api.empty();
  if (!needed) return absl::OkStatus();
  const std::string token = BearerToken(caller.authorization);
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "missing bearer token: send 'authorization: Bearer <token>' metadata");
  }
  const bool is_admin = !admin.empty() && SameToken(token, admin);
  const bool is_api = !api.empty() && SameToken(token, api);
  if (scope == Scope::kAdmin) {
    if (is_admin) return absl::OkStatus();
    if (is_api) return absl::PermissionDeniedError("adapter admin needs the admin token");
    return absl::UnauthenticatedError("invalid bearer token");
  }
  if (is_api || is_admin) return absl::OkStatus();
  return absl::UnauthenticatedError("invalid bearer token");
}

std::string Access::ClientOf(const Caller& caller) const {
  if (!caller.tls_identity.empty()) return absl::StrCat("tls:", caller.tls_identity);
  // Only a token this router knows names a client: an invented one would make every request a
  // new client and slip past the per-client stream cap.
  const std::string token = BearerToken(caller.authorization);
  const bool known = (!options_.api_token.empty() && SameToken(token, options_.api_token)) ||
                     (!options_.admin_token.empty() && SameToken(token, options_.admin_token));
  if (!token.empty() && known) return absl::StrCat("token:", absl::Hex(base::Fnv1a64(token)));
  return caller.address;
}

absl::StatusOr<Access::Slot> Access::OpenStream(const Caller& caller) {
  std::string client = ClientOf(caller);
  if (options_.max_streams_per_client <= 0) return Slot();
  absl::MutexLock lock(&mu_);
  int& open = streams_[client];
  if (open >= options_.max_streams_per_client) {
    if (open == 0) streams_.erase(client);
    return absl::ResourceExhaustedError(
        absl::StrCat("client ", client, " already has ", options_.max_streams_per_client,
                     " streams open (the limit per client; --max-streams-per-client)"));
  }
  ++open;
  return Slot(this, std::move(client));
}

void Access::Close(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(client);
  if (it != streams_.end() && --it->second <= 0) streams_.erase(it);
}

Access::Slot::Slot(Slot&& other) noexcept
    : access_(std::exchange(other.access_, nullptr)), client_(std::move(other.client_)) {}

Access::Slot& Access::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    if (access_ != nullptr) access_->Close(client_);
    access_ = std::exchange(other.access_, nullptr);
    client_ = std::move(other.client_);
  }
  return *this;
}

Access::Slot::~Slot() {
  if (access_ != nullptr) access_->Close(client_);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = base::ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file '", path, "': ", text.status().message()));
  }
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return token;
}

}  // namespace preft::router

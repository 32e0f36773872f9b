#pragma once

// Who may call the router and how much: bearer tokens for the public API and for adapter admin,
// and a cap on each client's concurrent Generate streams.
//
// Tokens travel as `authorization: Bearer <token>` metadata (what OpenAI-style SDKs send). With
// an admin token set, RegisterAdapter, LoadAdapter, UnloadAdapter and UpdateAdapter need it;
// with an API token set, every other RPC needs it (the admin token is accepted there too).
// Missing or unknown tokens are UNAUTHENTICATED; the API token on an admin RPC is
// PERMISSION_DENIED. Comparisons take the same time whatever the token's first wrong byte.
//
// A client, for the stream cap, is its TLS identity (the client certificate's subject, under
// mutual TLS), else its bearer token when it is one this router knows (the API or admin token),
// else its IP address (for calls from the in-process OpenAI front end, the HTTP client's): an
// unverified token names no one, so inventing tokens does not make new clients.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace preft::router {

struct AccessOptions {
  std::string admin_token;         // "" leaves adapter admin open
  std::string api_token;           // "" leaves generation open
  int max_streams_per_client = 0;  // 0: no cap
};

enum class Scope { kApi, kAdmin };

// Who is calling, as a call's transport tells it.
struct Caller {
  std::string authorization;  // the `authorization` header's value ("Bearer <token>"), or ""
  std::string tls_identity;   // the verified client certificate's subject (mutual TLS), or ""
  std::string address;        // the client's address without the port
};

// A gRPC call's caller (the OpenAI door names its HTTP clients itself: it calls Generate in
// process, never through gRPC).
Caller CallerOf(const grpc::ServerContextBase& context);

// Thread-safe.
class Access {
 public:
  explicit Access(AccessOptions options) : options_(std::move(options)) {}

  absl::Status Authorize(const Caller& caller, Scope scope) const;
  // A gRPC call's token only (no peer or TLS lookups: the token is all Authorize reads).
  absl::Status Authorize(const grpc::ServerContextBase& context, Scope scope) const;

  // A held stream slot; giving it back (destruction) frees it.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&&) noexcept;
    Slot& operator=(Slot&&) noexcept;
    ~Slot();

   private:
    friend class Access;
    Slot(Access* access, std::string client) : access_(access), client_(std::move(client)) {}
    Access* access_ = nullptr;
    std::string client_;
  };
  // RESOURCE_EXHAUSTED, naming the client and the cap, when it already holds the cap.
  absl::StatusOr<Slot> OpenStream(const Caller& caller);

  // The client's identity, as the stream cap counts it (for messages and tests).
  std::string ClientOf(const Caller& caller) const;

 private:
  void Close(const std::string& client);

  const AccessOptions options_;
  absl::Mutex mu_;
  std::map<std::string, int> streams_ ABSL_GUARDED_BY(mu_);
};

// Reads a token file (trailing whitespace trimmed). InvalidArgument naming the file when it is
// unreadable or empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace preft::router

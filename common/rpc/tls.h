#pragma once

// TLS and mutual TLS for every gRPC hop, from PEM files. One identity per process serves and
// dials: a worker presents the same certificate to the router that it serves with.
//
//   cert + key        serve TLS; present them as the client certificate when dialling
//   ca                verify peers: servers this process dials, and (mutual TLS) clients
//   require_client    with ca: refuse clients without a certificate signed by it
//
// No files: plaintext (a trusted network or a mesh that does TLS). UCX KV transfers (shared
// memory, RDMA, NVLink) are not gRPC and do not go through this.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace CLI {
class App;
}

namespace preft::rpc {

struct TlsFiles {
  std::string cert;  // PEM certificate chain
  std::string key;   // PEM private key
  std::string ca;    // PEM CA bundle
  bool require_client = true;

  bool serves_tls() const { return !cert.empty(); }
};

// Registers --tls-cert, --tls-key, --tls-ca and --tls-client-auth (require|none).
void AddTlsFlags(CLI::App& app, TlsFiles* files);

// InvalidArgument naming the file and the problem: unreadable, not PEM, a cert without its key
// (or the reverse), client auth required without a CA.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files);

}  // namespace preft::rpc

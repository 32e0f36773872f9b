#pragma once

// The flags every `preft` command that talks to a router takes (client, adapters, bench), and
// the SDK client they describe: one flag style for all of them.

#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "clients/cpp/preft_client.h"
#include "common/rpc/tls.h"

namespace preft::tools {

struct ConnectionFlags {
  std::string server = "127.0.0.1:50051";
  double timeout_s = 120;  // per call
  rpc::TlsFiles tls;
  std::string token, token_file;  // sent as `authorization: Bearer <token>`
};

// --server, --timeout-s, the TLS flags, --token, --token-file.
void AddConnectionFlags(CLI::App* cmd, ConnectionFlags* f);
// The SDK options the flags describe; InvalidArgument for an unreadable token file (its first
// line is the token).
absl::StatusOr<client::ClientOptions> ClientOptionsFrom(const ConnectionFlags& f);
// InvalidArgument for unreadable TLS or token files.
absl::StatusOr<std::unique_ptr<client::Client>> Connect(const ConnectionFlags& f);

}  // namespace preft::tools

#pragma once

// Binding a cpp-httplib server to "host:port" the same way everywhere (metrics, the OpenAI API).

#include <string>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace preft::http {

// Binds `server` to `address` (port 0 picks one) and returns "host:port" as bound. The caller
// then runs server.listen_after_bind() on a thread. InvalidArgument for an address that is not
// host:port; Unavailable, naming it, when it cannot be bound.
absl::StatusOr<std::string> Bind(httplib::Server& server, const std::string& address);

}  // namespace preft::http

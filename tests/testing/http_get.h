#pragma once

// A plain HTTP GET for tests (metrics endpoints), through cpp-httplib's client.

#include <httplib.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace preft::testing {

// The body of a 200 answer; Unavailable otherwise.
inline absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("'", host_port, "' is not host:port"));
  }
  httplib::Client client(host_port.substr(0, colon), port);
  client.set_connection_timeout(5);
  auto res = client.Get(path.c_str());
  if (!res || res->status != 200) {
    return absl::UnavailableError(absl::StrCat("GET http://", host_port, path, " failed"));
  }
  return res->body;
}

}  // namespace preft::testing

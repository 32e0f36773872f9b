#pragma once

// The one place absl::Status and grpc::Status meet (STYLE.md: convert once, at the edge).
// Both use the canonical google.rpc.Code set, so codes map 1:1 and the message is kept byte
// for byte. Not carried: absl payloads and gRPC's binary error details. A gRPC code outside
// the canonical set (DO_NOT_USE) becomes UNKNOWN.

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace preft::rpc {

grpc::StatusCode ToGrpcCode(absl::StatusCode code);
absl::StatusCode FromGrpcCode(grpc::StatusCode code);

// An OK status converts to OK with no message (absl::Status keeps none for OK).
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace preft::rpc

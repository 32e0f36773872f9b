#pragma once

// Opening a UCP context the way every preft UCX user does (transport and the bench's raw put
// probe): RMA + active messages + wakeup, with UcxTransportOptions applied over UCX_* settings.

#include <ucp/api/ucp.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/ucx/ucx_transport.h"

namespace preft::transport {

absl::StatusOr<ucp_context_h> CreateUcpContext(const UcxTransportOptions& options);

// Unavailable("UCX <what>: <UCX's words>").
absl::Status UcxError(const char* what, ucs_status_t status);

// The transports a context opened, in UCX's order with "self" last: {"posix", "self"}.
std::vector<std::string> ContextTransports(ucp_context_h context);

// Lane lines of ucp_ep_print_info on one line: which transport carries what.
std::string EndpointLanes(ucp_ep_h ep);

}  // namespace preft::transport

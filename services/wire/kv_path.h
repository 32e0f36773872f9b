#pragma once

// How a prefill worker tells the router that a Prefill call failed on the decode worker's side
// of the KV path (connecting to it, or a write it never acknowledged), not on its own: the
// router then moves the reservation to another decode worker and holds the failed one back,
// instead of retrying the prompt into the same reservation. A trailing-metadata key, so the
// gRPC status (UNAVAILABLE, with its message) stays what any client expects.

namespace preft::wire {

inline constexpr char kKvPathFailedKey[] = "preft-kv-path-failed";

}  // namespace preft::wire

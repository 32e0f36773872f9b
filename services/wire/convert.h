#pragma once

// Engine and transport types <-> their protos (preft.v1 / preft.worker.v1), converted once at
// the edge of every service.

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/adapters/adapter_store.h"
#include "common/engine/request.h"
#include "common/engine/sampling_params.h"
#include "common/model/adapter_weights.h"
#include "common/transport/kv_transport.h"
#include "proto/preft/v1/preft.pb.h"
#include "proto/preft/v1/worker.pb.h"

namespace preft::wire {

// Unset fields take the engine's defaults. Values are range-checked later by
// SamplingParams::Validate (which names the field).
engine::SamplingParams FromProto(const v1::SamplingParams& p);
// Every field set (seed included when known), so the far side uses exactly these.
v1::SamplingParams ToProto(const engine::SamplingParams& s);

engine::TokenLogprob FromProto(const v1::TokenLogprob& p);
v1::TokenLogprob ToProto(const engine::TokenLogprob& l);

// UNSPECIFIED: nullopt (the adapter's default).
std::optional<model::AdapterPositions> FromProto(v1::AdapterPositions p);
v1::AdapterPositions ToProto(std::optional<model::AdapterPositions> p);

// kNone and kError have no proto value (an error is the call's status): UNSPECIFIED.
v1::FinishReason ToProto(engine::FinishReason r);
// "length", "stop", "abort"; "" for unspecified.
const char* FinishReasonName(v1::FinishReason r);

// A worker's answer to LoadAdapter: the version now resident there.
worker::v1::AdapterState ResidentState(const std::string& name, int64_t version, int64_t bytes);

// A worker Status's adapter list: each version in `versions` (name -> newest version, as
// VersionedAdapters::versions), with its residency and size from `store_list` (the worker's
// AdapterStore::List, keyed by VersionKey): RESIDENT, HOST, LOADING where `loading(key)`
// holds, else DISK.
void AppendAdapterStates(const std::map<std::string, int64_t>& versions,
                         const std::vector<adapters::AdapterInfo>& store_list,
                         const std::function<bool(const std::string& key)>& loading,
                         google::protobuf::RepeatedPtrField<worker::v1::AdapterState>* out);

// The endpoint a worker advertises for its transport and cache layout.
worker::v1::TransportEndpoint MakeEndpoint(const transport::KvTransport& transport,
                                           const transport::KvLayout& layout);

}  // namespace preft::wire

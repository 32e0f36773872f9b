#pragma once

// Worker-side types (adapter residency, transport endpoints) <-> their protos (preft.worker.v1);
// request types are in request_convert.h.

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/adapters/adapter_store.h"
#include "common/transport/kv_transport.h"
#include "proto/preft/v1/worker.pb.h"
#include "services/wire/request_convert.h"

namespace preft::wire {

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

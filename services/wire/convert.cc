#include "services/wire/convert.h"

#include "common/adapters/versioned_adapters.h"

namespace preft::wire {

worker::v1::TransportEndpoint MakeEndpoint(const transport::KvTransport& transport,
                                           const transport::KvLayout& layout) {
  worker::v1::TransportEndpoint e;
  e.set_address(transport.LocalAddress());
  e.set_layout_hash(layout.Hash());
  e.set_layout(layout.ToString());
  e.set_transport(transport.name());
  return e;
}

worker::v1::AdapterState ResidentState(const std::string& name, int64_t version, int64_t bytes) {
  worker::v1::AdapterState s;
  s.set_name(name);
  s.set_version(version);
  s.set_residency(v1::ADAPTER_RESIDENCY_RESIDENT);
  s.set_bytes(bytes);
  return s;
}

void AppendAdapterStates(const std::map<std::string, int64_t>& versions,
                         const std::vector<adapters::AdapterInfo>& store_list,
                         const std::function<bool(const std::string& key)>& loading,
                         google::protobuf::RepeatedPtrField<worker::v1::AdapterState>* out) {
  std::map<std::string, const adapters::AdapterInfo*> by_key;
  for (const adapters::AdapterInfo& info : store_list) by_key[info.name] = &info;
  for (const auto& [name, version] : versions) {
    const std::string key = adapters::VersionKey(name, version);
    worker::v1::AdapterState* a = out->Add();
    a->set_name(name);
    a->set_version(version);
    auto it = by_key.find(key);
    const adapters::AdapterInfo* info = it == by_key.end() ? nullptr : it->second;
    if (info != nullptr && info->in_compute) {
      a->set_residency(v1::ADAPTER_RESIDENCY_RESIDENT);
    } else if (info != nullptr && info->in_host) {
      a->set_residency(v1::ADAPTER_RESIDENCY_HOST);
    } else if (loading(key)) {
      a->set_residency(v1::ADAPTER_RESIDENCY_LOADING);
    } else {
      a->set_residency(v1::ADAPTER_RESIDENCY_DISK);
    }
    a->set_bytes(info != nullptr ? info->bytes : 0);
    a->set_pins(info != nullptr ? static_cast<int32_t>(info->pins) : 0);
  }
}

}  // namespace preft::wire

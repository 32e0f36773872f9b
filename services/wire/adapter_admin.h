#pragma once

// LoadAdapter and UnloadAdapter as every worker that runs adapters answers them (prefill
// workers; decode workers that are colocated or run the all-position baseline): a load pins
// the version like a request's adapter, then unpins it before answering, so it stays resident
// until evicted; an unload forgets the name (requests holding a version keep it).

#include <functional>

#include <grpcpp/grpcpp.h>

#include "common/adapters/versioned_adapters.h"
#include "proto/preft/v1/worker.pb.h"

namespace preft::wire {

// `on_end` (may be empty) runs when the load ends, before the answer, whatever its outcome.
void LoadAdapterFor(adapters::VersionedAdapters& versioned,
                    const worker::v1::WorkerAdapterRequest& request,
                    worker::v1::AdapterState* response, grpc::ServerUnaryReactor* reactor,
                    std::function<void()> on_end = nullptr);

void UnloadAdapterFor(adapters::VersionedAdapters& versioned,
                      const worker::v1::WorkerAdapterRequest& request,
                      grpc::ServerUnaryReactor* reactor);

}  // namespace preft::wire

#include "services/wire/adapter_admin.h"

#include <utility>

#include "common/rpc/status.h"
#include "services/wire/convert.h"

namespace preft::wire {

void LoadAdapterFor(adapters::VersionedAdapters& versioned,
                    const worker::v1::WorkerAdapterRequest& request,
                    worker::v1::AdapterState* response, grpc::ServerUnaryReactor* reactor,
                    std::function<void()> on_end) {
  versioned.Acquire(
      request.name(), request.version(), request.path(),
      [reactor, response, on_end = std::move(on_end)](absl::StatusOr<adapters::AdapterPin> pin) {
        if (on_end) on_end();
        if (pin.ok()) {
          *response = ResidentState(pin->name, pin->version,
                                    static_cast<int64_t>(pin->weights->bytes()));
        }
        const absl::Status status = pin.status();
        pin = absl::CancelledError();  // unpinned before the caller hears back
        reactor->Finish(rpc::ToGrpcStatus(status));
      });
}

void UnloadAdapterFor(adapters::VersionedAdapters& versioned,
                      const worker::v1::WorkerAdapterRequest& request,
                      grpc::ServerUnaryReactor* reactor) {
  versioned.Forget(request.name());
  reactor->Finish(grpc::Status::OK);
}

}  // namespace preft::wire

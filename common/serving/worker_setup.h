#pragma once

// What every preft worker process does the same way before it serves: load the base model
// and tokenizer, size the engine, pick the KV transport, describe the KV layout, and wait for
// SIGTERM. Shared by preft-prefill, preft-decode and `preft serve`.

#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "common/adapters/adapter_store.h"
#include "common/engine/engine.h"
#include "common/metrics/engine_metrics.h"
#include "common/metrics/metrics_server.h"
#include "common/model/model.h"
#include "common/rpc/tls.h"
#include "common/text/tokenizer.h"
#include "common/transport/kv_transport.h"

namespace preft::serving {

struct LoadedModel {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<text::Tokenizer> tokenizer;  // null if the folder has no tokenizer.json
  // Identifies the base weights in KV layouts: two workers exchange KV only if they agree.
  // Architecture, a hash of config.json and the weight files' sizes (no full-file hash: a
  // real checkpoint is gigabytes).
  std::string fingerprint;
};

// Errors name the folder and the problem (the loaders' messages).
absl::StatusOr<LoadedModel> LoadModel(const std::string& dir);

struct TransportFlags {
  // "ucx", "cuda_ipc" (device to device; notices over UCX), "grpc" (the fallback;
  // services/wire) or "inproc"
  std::string kind = "ucx";
  std::string ucx_tls;       // UCX_TLS for this worker ("" = environment / UCX default)
  std::string ucx_net_devices;
  // A KV write not acknowledged within this fails and drops the peer (the next write connects
  // again). Well under the router's admission timeout, so a retry elsewhere still has time.
  double kv_transfer_timeout_s = 10;
  // UcxTransportOptions::spin: how long the progress thread busy-polls after activity before
  // sleeping (0: at once, right where engines share the cores).
  double ucx_spin_us = 0;
};

// InvalidArgument for an unknown kind; "cuda_ipc" moves `device_cache` (the engine's
// backend's), and is FailedPrecondition where the cache is not on a GPU.
absl::StatusOr<std::unique_ptr<transport::KvTransport>> MakeTransport(
    const TransportFlags& flags, kv::DeviceKvView device_cache = {});

// Readiness: OK unless UCX was configured with explicit transports (`ucx_tls`) and the ones it
// opened, named in `opened` ("ucx(posix,self)"), differ (FailedPrecondition naming both), or
// cuda_ipc was asked for and `opened` is another path ("cuda_ipc+ucx(...)" is the one). UCX
// aliases (shm, sm, ib, all, ...) are not checked.
inline constexpr char kCudaIpcPrefix[] = "cuda_ipc+";
absl::Status CheckTransport(const std::string& opened, const TransportFlags& flags);

// --kv-dtype (vLLM's --kv-cache-dtype): how the KV cache stores K and V. "auto" is the
// checkpoint's dtype: bf16 KV for a bf16 checkpoint, f32 for the rest (an f32 model keeps its
// exact f32 references; an f16 one would lose range in bf16). fp8_e4m3 is never automatic.
inline constexpr char kKvDtypeHelp[] =
    "how the KV cache stores K and V: auto (the checkpoint's dtype: bf16 for bf16 checkpoints, "
    "else f32), f32, bf16 (half the bytes: twice the sequences per GiB, half the KV on the "
    "wire), or fp8_e4m3 (a quarter of f32's bytes; K and V divided by the checkpoint's "
    "k_scale/v_scale, else 1, and rounded to 3 mantissa bits). Prefill and "
    "decode workers that exchange KV must store the same";
void AddKvDtypeFlag(CLI::App& app, std::string* flag);

// Prefix caching (engine::EngineOptions): on unless --no-prefix-caching; --prefix-cache-blocks
// caps the blocks that keep cached content (0: any block may, evicted only when needed).
struct PrefixCacheFlags {
  bool off = false;
  int64_t max_blocks = 0;

  void ApplyTo(engine::EngineOptions* options) const {
    options->prefix_caching = !off;
    options->max_cached_blocks = max_blocks;
  }
};
void AddPrefixCacheFlags(CLI::App& app, PrefixCacheFlags* flags);
// The dtype `flag` names for a model whose weights are `weights`.
absl::StatusOr<kv::KvDtype> ResolveKvDtype(const std::string& flag, kernels::DType weights);

// The flags every worker binary takes (preft-prefill, preft-decode), registered the same way.
struct WorkerFlags {
  std::string model;
  std::string listen = "127.0.0.1:0";
  std::string metrics_listen;  // host:port of GET /metrics; empty: none
  int64_t kv_bytes = 0;   // 0: 1 GiB on the CPU; on a GPU, a share of its free memory
  int64_t kv_blocks = 0;  // instead of kv_bytes
  int64_t max_batch_tokens = 512;
  std::string kv_dtype = "auto";  // see kKvDtypeHelp
  PrefixCacheFlags prefix_cache;
  int threads = 0;  // 0: all cores
  // "cuda": the engine's forward on the first GPU (weights as bf16, the KV cache in device
  // memory sized from what is free unless kv_blocks is set; a worker that moves KV over a
  // host-memory transport stages it through a host mirror of that size, 8 GiB unless set;
  // --transport cuda_ipc moves the device blocks themselves).
  std::string device = "cpu";
  // With "cuda": the model split over this many GPUs (0 .. N-1) by tensor parallelism; its
  // KV moves between tiers through host memory (not --transport cuda_ipc).
  int tensor_parallel = 1;
  TransportFlags transport;
  double drain_timeout_s = 30;
  // On SIGTERM, new calls are answered UNAVAILABLE ("draining") for at least this long before
  // the server shuts down, so routers see the drain (their status poll) and retry elsewhere
  // instead of meeting a bare CANCELLED.
  double drain_min_s = 1;
  rpc::TlsFiles tls;  // the worker's gRPC server, and the channels it dials
};
void AddWorkerFlags(CLI::App& app, WorkerFlags* flags);

// The adapter store's flags: prefill workers, and decode workers that run adapters (the
// all-position baseline). Budgets must fit the adapters of one batch: a decode step of the
// baseline pins every running request's adapter in compute memory.
struct AdapterStoreFlags {
  std::string root;  // adapter folders must lie under it; "" accepts none
  int64_t host_bytes = int64_t{4} << 30;
  int64_t compute_bytes = int64_t{1} << 30;
  int64_t max_rank = 128;
  int loader_threads = 1;  // adapters loaded from disk at once
  int loader_nice = 10;    // AdapterStoreOptions::loader_nice
};
void AddAdapterStoreFlags(CLI::App& app, AdapterStoreFlags* flags);
// The store's options, computing in `compute_dtype` (the model's weight dtype).
adapters::AdapterStoreOptions StoreOptions(const AdapterStoreFlags& flags,
                                           kernels::DType compute_dtype);

// The worker's model, tokenizer and engine, sized by the flags, and with --metrics-listen its
// metrics endpoint (serving before the weights load) with the engine's metrics attached.
// Errors name what failed. Destroy the engine (or the service that took it) first: the engine
// reports to `engine_metrics`.
struct WorkerEngine {
  std::unique_ptr<metrics::MetricsServer> metrics;  // null without --metrics-listen
  std::unique_ptr<metrics::EngineMetrics> engine_metrics;
  LoadedModel model;
  std::unique_ptr<engine::Engine> engine;
};
// `kv_transport`: the worker hands KV to other workers or takes it from them (prefill and
// disaggregated decode workers), as MakeEngine's; with --transport cuda_ipc no host mirror.
absl::StatusOr<WorkerEngine> MakeWorkerEngine(const WorkerFlags& flags, bool kv_transport);

// An engine over `model` on `device`: "cpu" (the model's own forward, `options` as given) or
// "cuda" (a CudaBackend over `tensor_parallel` GPUs whose KV cache holds options.kv_blocks
// blocks, else kv_bytes when positive, else a share of the free device memory).
// tensor_parallel > 1 needs "cuda" (InvalidArgument otherwise). With `kv_transport` (its KV
// moves to or from other workers through host memory) a device cache keeps a host mirror for
// the transport, and its size defaults to kMirroredKvBytes rather than the device's free
// memory. Errors start with "--device DEVICE: ".
inline constexpr int64_t kMirroredKvBytes = int64_t{8} << 30;
absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(model::Model* model,
                                                           const text::Tokenizer* tokenizer,
                                                           const std::string& device,
                                                           const engine::EngineOptions& options,
                                                           bool kv_transport,
                                                           int tensor_parallel = 1);

// The engine cache's layout under `fingerprint`.
transport::KvLayout LayoutFor(engine::Engine& engine, const std::string& fingerprint);

// Worker processes share cores with other workers (and pods share a CPU quota): OpenMP threads
// spinning while idle starve them (measured: a 2-core multi-process cluster ran at 0.02x the
// engine's throughput with libgomp's default spin, 0.62x with passive waits). libgomp reads
// OMP_WAIT_POLICY only when it loads, so when the variable is unset this sets it to "passive"
// and re-executes the binary; set OMP_WAIT_POLICY=active to keep spinning on dedicated cores.
// Call first thing in main.
void UsePassiveOpenMpWaits(char** argv);

}  // namespace preft::serving

#include "common/serving/worker_setup.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/fnv.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/metrics/families.h"
#ifdef PREFT_HAVE_CUDA
#include "common/backend/cuda_backend.h"
#endif
#include "common/transport/inproc_transport.h"
#ifdef PREFT_HAVE_UCX
#include "common/transport/ucx/ucx_transport.h"
#endif
#ifdef PREFT_HAVE_CUDA_IPC
#include "common/transport/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace preft::serving {

absl::StatusOr<LoadedModel> LoadModel(const std::string& dir) {
  LoadedModel out;
  PREFT_ASSIGN_OR_RETURN(out.model, model::Model::Load(dir));
  if (std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json")) {
    PREFT_ASSIGN_OR_RETURN(out.tokenizer, text::Tokenizer::LoadFromModelDir(dir));
  }
  PREFT_ASSIGN_OR_RETURN(std::string config, base::ReadFileToString(dir + "/config.json"));
  std::string weights;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") {
      absl::StrAppend(&weights, entry.path().filename().string(), ":", entry.file_size(ec), ";");
    }
  }
  const uint64_t h = base::Fnv1a64(weights, base::Fnv1a64(config + '\0'));
  out.fingerprint = absl::StrFormat("%s-%016x", out.model->config().architecture_name, h);
  return out;
}

absl::StatusOr<std::unique_ptr<transport::KvTransport>> MakeTransport(
    const TransportFlags& flags, kv::DeviceKvView device_cache) {
  if (flags.kind == "inproc") return std::make_unique<transport::InprocTransport>();
#ifdef PREFT_HAVE_UCX
  transport::UcxTransportOptions o;
  o.tls = flags.ucx_tls;
  o.net_devices = flags.ucx_net_devices;
  o.transfer_timeout = absl::Seconds(flags.kv_transfer_timeout_s);
  o.spin = absl::Microseconds(flags.ucx_spin_us);
  if (flags.kind == "ucx") return std::make_unique<transport::UcxTransport>(o);
#else
  if (flags.kind == "ucx" || flags.kind == "cuda_ipc") {
    return absl::FailedPreconditionError(absl::StrCat(
        "--transport ", flags.kind, ": this build has no UCX (PREFT_ENABLE_UCX=OFF, or Debian's "
        "libucx-dev was missing when it was configured); use --transport grpc"));
  }
#endif
  if (flags.kind == "cuda_ipc") {
    if (device_cache.base == nullptr) {
      return absl::FailedPreconditionError(
          "--transport cuda_ipc moves KV between GPU caches: run the worker with --device cuda");
    }
#ifdef PREFT_HAVE_CUDA_IPC
    return std::make_unique<transport::CudaIpcTransport>(
        device_cache, std::make_unique<transport::UcxTransport>(o));
#else
    return absl::FailedPreconditionError("--transport cuda_ipc: this build has no CUDA");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown transport '", flags.kind,
      "' (expected ucx, cuda_ipc or inproc here; grpc is made by the services)"));
}

absl::Status CheckTransport(const std::string& opened_name, const TransportFlags& flags) {
  absl::string_view opened = opened_name;
  if (flags.kind == "cuda_ipc") {
    // "cuda_ipc+ucx(...)": the data path, then the notices' UCX transports.
    if (!absl::ConsumePrefix(&opened, kCudaIpcPrefix)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "KV transport ", opened_name, " opened, but --transport cuda_ipc was asked for"));
    }
  } else if (flags.kind != "ucx") {
    return absl::OkStatus();
  }
  if (flags.ucx_tls.empty()) return absl::OkStatus();
  std::set<std::string> want;
  for (absl::string_view t : absl::StrSplit(flags.ucx_tls, ',', absl::SkipEmpty())) {
    const std::string name(absl::StripAsciiWhitespace(t));
    if (name == "shm" || name == "sm" || name == "ib" || name == "all" || name == "mm" ||
        name == "rc" || name == "dc" || name == "ud" || name == "cuda" || name == "rocm" ||
        name[0] == '^') {
      return absl::OkStatus();  // an alias or an exclusion: UCX picks the members
    }
    want.insert(name);
  }
  const size_t open = opened.find('('), close = opened.rfind(')');
  std::set<std::string> got;
  if (open != absl::string_view::npos && close != absl::string_view::npos && close > open) {
    for (absl::string_view t : absl::StrSplit(opened.substr(open + 1, close - open - 1), ',',
                                              absl::SkipEmpty())) {
      got.emplace(t);
    }
  }
  if (got != want) {
    return absl::FailedPreconditionError(absl::StrCat(
        "UCX opened ", opened, " but --ucx-tls asks for ", flags.ucx_tls,
        ": refusing readiness (check UCX_* settings and devices)"));
  }
  return absl::OkStatus();
}

void AddKvDtypeFlag(CLI::App& app, std::string* flag) {
  app.add_option("--kv-dtype", *flag, kKvDtypeHelp)
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "f32", "bf16", "fp8_e4m3"}));
}

void AddPrefixCacheFlags(CLI::App& app, PrefixCacheFlags* flags) {
  app.add_flag("--no-prefix-caching", flags->off,
               "compute every prompt whole (by default full KV blocks stay cached by content, "
               "adapter and version, and a prompt starts after its longest cached prefix)");
  app.add_option("--prefix-cache-blocks", flags->max_blocks,
                 "at most this many KV blocks keep cached content (0: any; cached blocks are "
                 "reclaimed only when new tokens need them)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

absl::StatusOr<kv::KvDtype> ResolveKvDtype(const std::string& flag, kernels::DType weights) {
  kv::KvDtype d;
  if (flag == "auto") return weights == kernels::DType::kBF16 ? kv::KvDtype::kBF16 : kv::KvDtype::kF32;
  if (!kernels::ParseKvDtype(flag, &d)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-dtype ", flag, ": expected auto, f32, bf16 or fp8_e4m3"));
  }
  return d;
}

void AddWorkerFlags(CLI::App& app, WorkerFlags* f) {
  app.add_option("--model", f->model, "base model folder (config.json, safetensors, tokenizer)")
      ->required();
  app.add_option("--listen", f->listen, "gRPC address host:port (port 0 picks one)")
      ->capture_default_str();
  rpc::AddTlsFlags(app, &f->tls);
  app.add_option("--metrics-listen", f->metrics_listen,
                 "serve Prometheus metrics on host:port (GET /metrics); none if unset");
  auto* kv_bytes = app.add_option("--kv-bytes", f->kv_bytes,
                                  "KV cache budget in bytes (default: 1 GiB on the CPU; with "
                                  "--device cuda, 85% of the device memory the weights and "
                                  "adapter slots leave)")
                       ->check(CLI::PositiveNumber);
  app.add_option("--kv-blocks", f->kv_blocks, "KV cache size in blocks (instead of --kv-bytes)")
      ->check(CLI::PositiveNumber)
      ->excludes(kv_bytes);
  app.add_option("--max-batch-tokens", f->max_batch_tokens, "tokens per forward step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", f->threads, "compute threads (0: all cores)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  AddKvDtypeFlag(app, &f->kv_dtype);
  AddPrefixCacheFlags(app, &f->prefix_cache);
  app.add_option("--device", f->device,
                 "where the forward runs: cpu, or cuda (the first GPU; a prefill or disaggregated "
                 "decode worker stages KV through host memory unless --transport cuda_ipc)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--tensor-parallel", f->tensor_parallel,
                 "split the model over this many GPUs (with --device cuda; NCCL between them; "
                 "KV to other workers through host memory, not cuda_ipc)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
#ifndef PREFT_HAVE_UCX
  if (f->transport.kind == "ucx") f->transport.kind = "grpc";  // the default where UCX is absent
#endif
  app.add_option("--transport", f->transport.kind,
                 "KV transport: ucx, cuda_ipc (GPU to GPU on one node, with --device cuda; "
                 "notices over UCX), grpc or inproc")
      ->capture_default_str()
      ->check(CLI::IsMember({"ucx", "cuda_ipc", "grpc", "inproc"}));
  app.add_option("--ucx-tls", f->transport.ucx_tls,
                 "UCX_TLS for this worker, e.g. posix,self (readiness is refused on others)");
  app.add_option("--ucx-net-devices", f->transport.ucx_net_devices, "UCX_NET_DEVICES, e.g. lo");
  app.add_option("--ucx-spin-us", f->transport.ucx_spin_us,
                 "after a transfer the UCX progress thread busy-polls this long before sleeping; "
                 "0 (sleep at once) unless it has a core of its own")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--kv-transfer-timeout-s", f->transport.kv_transfer_timeout_s,
                 "a KV write (UCX) not acknowledged within this fails, and its decode worker is "
                 "tried again on the next write; keep it under the router's admission timeout")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--drain-timeout-s", f->drain_timeout_s,
                 "on SIGTERM, how long work in flight may take to finish")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--drain-min-s", f->drain_min_s,
                 "on SIGTERM, answer new calls UNAVAILABLE (draining) for at least this long "
                 "before shutting down, so routers retry elsewhere")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

void AddAdapterStoreFlags(CLI::App& app, AdapterStoreFlags* f) {
  app.add_option("--adapter-root", f->root,
                 "adapter folders must lie under this folder (none accepted if unset)");
  app.add_option("--adapter-host-bytes", f->host_bytes,
                 "parsed adapters kept in host memory, in bytes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--adapter-compute-bytes", f->compute_bytes, "adapter compute slots, in bytes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-rank", f->max_rank, "adapters of a higher rank are refused")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--adapter-loader-threads", f->loader_threads,
                 "adapters loaded from disk at once (each load also takes a core)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--adapter-loader-nice", f->loader_nice,
                 "loader threads run this much nicer than the engine, so a load takes what the "
                 "engine leaves rather than stalling a step (0: same priority)")
      ->check(CLI::Range(0, 19))
      ->capture_default_str();
}

adapters::AdapterStoreOptions StoreOptions(const AdapterStoreFlags& f, kernels::DType compute_dtype) {
  adapters::AdapterStoreOptions o;
  o.host_bytes = f.host_bytes;
  o.compute_bytes = f.compute_bytes;
  o.load.max_rank = f.max_rank;
  o.loader_threads = f.loader_threads;
  o.loader_nice = f.loader_nice;
  o.load.dtype = compute_dtype;
  return o;
}

absl::StatusOr<WorkerEngine> MakeWorkerEngine(const WorkerFlags& f, bool kv_transport) {
  WorkerEngine w;
  if (!f.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> m =
        metrics::MetricsServer::Start(f.metrics_listen);
    if (!m.ok()) {
      return absl::Status(m.status().code(),
                          absl::StrCat("--metrics-listen ", f.metrics_listen, ": ",
                                       m.status().message()));
    }
    w.metrics = *std::move(m);
    w.engine_metrics = std::make_unique<metrics::EngineMetrics>(w.metrics->registry());
  }
  if (f.tensor_parallel > 1 && kv_transport && f.transport.kind == "cuda_ipc") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--transport cuda_ipc maps one GPU's KV pool; with --tensor-parallel ", f.tensor_parallel,
        " the KV is split over GPUs and moves through host memory: use --transport ucx"));
  }
  PREFT_ASSIGN_OR_RETURN(w.model, LoadModel(f.model));
  engine::EngineOptions o;
  // Unset: 1 GiB on the CPU; on a GPU (0) a share of its free memory.
  o.kv_bytes = f.kv_bytes > 0 ? f.kv_bytes : f.device == "cpu" ? int64_t{1} << 30 : 0;
  o.kv_blocks = f.kv_blocks;
  o.scheduler.max_batch_tokens = f.max_batch_tokens;
  o.num_threads = f.threads;
  f.prefix_cache.ApplyTo(&o);
  PREFT_ASSIGN_OR_RETURN(o.kv_dtype,
                         ResolveKvDtype(f.kv_dtype, w.model.model->weight_dtype()));
  PREFT_ASSIGN_OR_RETURN(
      w.engine,
      MakeEngine(w.model.model.get(), w.model.tokenizer.get(), f.device, o,
                 kv_transport && f.transport.kind != "cuda_ipc", f.tensor_parallel));
  w.engine->set_observer(w.engine_metrics.get());
  if (w.metrics != nullptr) {
    // vllm:cache_config_info's counterpart: what a block holds and how many there are.
    const kv::KvCacheShape& shape = w.engine->backend().cache_shape();
    metrics::GaugeFamily(w.metrics->registry(), "preft:cache_config_info",
                         "The KV cache's configuration (value 1): kv_dtype, block_tokens, "
                         "num_blocks, block_bytes (every layer)")
        .Add({{"kv_dtype", std::string(kv::KvDtypeName(shape.dtype))},
              {"block_tokens", absl::StrCat(shape.block_tokens)},
              {"num_blocks", absl::StrCat(shape.num_blocks)},
              {"block_bytes", absl::StrCat(shape.bytes_per_block_all_layers())}})
        .Set(1);
  }
  return w;
}

absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(model::Model* model,
                                                           const text::Tokenizer* tokenizer,
                                                           const std::string& device,
                                                           const engine::EngineOptions& options,
                                                           bool kv_transport,
                                                           int tensor_parallel) {
  if (tensor_parallel != 1 && device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tensor-parallel ", tensor_parallel, " splits the model over GPUs: use --device cuda"));
  }
  if (device == "cpu") return engine::Engine::Create(model, tokenizer, options);
#ifdef PREFT_HAVE_CUDA
  if (device == "cuda") {
    backend::CudaBackend::Options co;
    co.kv_blocks = options.kv_blocks;
    co.kv_dtype = options.kv_dtype;
    co.host_mirror = kv_transport;
    co.tensor_parallel = tensor_parallel;
    // A mirrored pool takes as much host memory as device memory: not a share of the GPU's.
    const int64_t kv_bytes =
        options.kv_bytes > 0 ? options.kv_bytes : kv_transport ? kMirroredKvBytes : 0;
    if (co.kv_blocks == 0 && kv_bytes > 0) {
      const model::ModelConfig& c = model->config();
      const kv::KvCacheShape one{c.num_layers,   1,         co.block_tokens,
                                 c.num_kv_heads, c.head_dim, co.kv_dtype};
      co.kv_blocks = std::max<int64_t>(1, kv_bytes / one.bytes_per_block_all_layers());
    }
    absl::StatusOr<std::unique_ptr<backend::CudaBackend>> backend =
        backend::CudaBackend::Create(*model, co);
    if (!backend.ok()) {
      return absl::Status(backend.status().code(),
                          absl::StrCat("--device cuda: ", backend.status().message()));
    }
    return engine::Engine::Create(*std::move(backend), tokenizer, options);
  }
#endif
  return absl::FailedPreconditionError(absl::StrCat(
      "--device ", device, ": this build has no such backend (cuda needs PREFT_ENABLE_CUDA=ON "
      "where nvcc and cuBLAS are installed)"));
}

transport::KvLayout LayoutFor(engine::Engine& engine, const std::string& fingerprint) {
  return transport::KvLayout::ForCache(engine.backend().cache_shape(), fingerprint);
}

void UsePassiveOpenMpWaits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);
  // execv failed (no /proc): go on with the default policy.
}

}  // namespace preft::serving

// `preft serve`: the embedded cluster (router + prefill + decode in one process; or router +
// colocated workers with --colocated).

#include <cstdio>
#include <filesystem>

#include "common/base/termination_signal.h"
#include "common/log/log.h"
#include "common/model/make_model.h"
#include "common/serving/worker_setup.h"
#include "tools/preft/commands.h"
#include "tools/preft/embedded_cluster.h"

namespace preft::tools {

namespace {

struct ServeFlags {
  std::string model = "models/demo-tiny";
  std::string preset;  // make the model first when the folder has none
  std::string listen = "127.0.0.1:50051";
  std::string http_listen;
  std::string adapter_root;
  int prefill_workers = 1;
  int decode_workers = 1;
  int64_t prefill_kv_mib = 256;
  int64_t decode_kv_mib = 512;
  std::string kv_dtype = "auto";
  serving::PrefixCacheFlags prefix_cache;
  int threads = 0;
  std::string device = "cpu";
  std::string decode_adapters = "none";
  bool colocated = false;
  double drain_timeout_s = 30;
  log::Options log;
};

int RunServe(const ServeFlags& f) {
  log::Init(f.log);
  if (!std::filesystem::exists(f.model + "/config.json")) {
    // The default folder is the demo model: made on first run.
    const std::string preset = f.preset.empty() && f.model == ServeFlags().model ? "tiny" : f.preset;
    if (preset.empty()) {
      std::fprintf(stderr, "preft serve: no model in '%s' (pass --preset to make one)\n",
                   f.model.c_str());
      return 1;
    }
    model::MakeModelOptions m;
    m.preset = preset;
    m.out_dir = f.model;
    m.seed = 7;
    std::printf("making the demo model (%s) in %s\n", preset.c_str(), f.model.c_str());
    if (absl::Status s = model::MakeModel(m); !s.ok()) {
      std::fprintf(stderr, "preft serve: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  base::InstallTerminationHandler();
  EmbeddedClusterOptions o;
  o.model_dir = f.model;
  o.listen = f.listen;
  o.http_listen = f.http_listen;
  o.adapter_root = f.adapter_root;
  o.num_prefill = f.prefill_workers;
  o.num_decode = f.decode_workers;
  o.prefill_kv_bytes = f.prefill_kv_mib << 20;
  o.decode_kv_bytes = f.decode_kv_mib << 20;
  o.prefill_kv_dtype = o.decode_kv_dtype = f.kv_dtype;
  o.prefix_cache = f.prefix_cache;
  o.threads = f.threads;
  o.device = f.device;
  o.decode.all_position_adapters = f.decode_adapters == "all-positions";
  o.colocated = f.colocated;
  o.decode.adapter_root = f.adapter_root;
  auto cluster = EmbeddedCluster::Start(o);
  if (!cluster.ok()) {
    std::fprintf(stderr, "preft serve: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  if (f.colocated) {
    std::printf("preft serve listening on %s (colocated workers %d)\n",
                (*cluster)->address().c_str(), f.decode_workers);
  } else {
    std::printf("preft serve listening on %s (prefill workers %d, decode workers %d)\n",
                (*cluster)->address().c_str(), f.prefill_workers, f.decode_workers);
  }
  if (!f.http_listen.empty()) {
    std::printf("preft serve: OpenAI-compatible HTTP on http://%s/v1\n",
                (*cluster)->http_address().c_str());
  }
  std::fflush(stdout);
  base::WaitForTerminationSignal();
  std::printf("preft serve: draining\n");
  std::fflush(stdout);
  (*cluster)->Drain(absl::Seconds(f.drain_timeout_s));
  return 0;
}

}  // namespace

void RegisterServeCommand(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<ServeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "run the whole cluster in one process (router, prefill and decode workers)");
  cmd->add_option("--model", flags->model, "base model folder");
  cmd->add_option("--preset", flags->preset, "make a random model of this preset if --model has none");
  cmd->add_option("--listen", flags->listen, "public gRPC address (port 0 picks one)");
  cmd->add_option("--http-listen", flags->http_listen,
                  "OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /v1/models)");
  cmd->add_option("--adapter-root", flags->adapter_root, "adapters may be registered from under this folder");
  CLI::Option* prefill_workers =
      cmd->add_option("--prefill-workers", flags->prefill_workers)->check(CLI::Range(1, 64));
  cmd->add_option("--decode-workers", flags->decode_workers, "decode (or colocated) workers")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--prefill-kv-mib", flags->prefill_kv_mib)->check(CLI::PositiveNumber);
  cmd->add_option("--decode-kv-mib", flags->decode_kv_mib)->check(CLI::PositiveNumber);
  serving::AddKvDtypeFlag(*cmd, &flags->kv_dtype);
  serving::AddPrefixCacheFlags(*cmd, &flags->prefix_cache);
  cmd->add_option("--threads", flags->threads, "compute threads per engine (0: all cores)");
  cmd->add_option("--device", flags->device,
                  "where the workers' forward runs: cpu, or cuda (the first GPU; with "
                  "--colocated, until a KV transport reaches device memory)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI::Option* adapters =
      cmd->add_option("--adapters", flags->decode_adapters,
                      "decode workers: none (PreFT) or all-positions (also the multi-LoRA "
                      "baseline)")
          ->capture_default_str()
          ->check(CLI::IsMember({"none", "all-positions"}));
  cmd->add_flag("--colocated", flags->colocated,
                "no prefill tier: each worker runs whole requests (prompt with its adapter, then "
                "decode) in one engine, as vLLM does without disaggregation")
      ->excludes(prefill_workers)
      ->excludes(adapters);
  cmd->add_option("--drain-timeout-s", flags->drain_timeout_s);
  flags->log.service = "preft-serve";
  log::AddFlags(*cmd, &flags->log);
  cmd->callback([flags, exit_code] { *exit_code = RunServe(*flags); });
}

}  // namespace preft::tools

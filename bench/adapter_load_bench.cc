// What one adapter load from disk (page cache) costs, as a CPU worker's store does it (compute
// dtype of the model, the CPU kernels' chunked layout), against two references measured in the
// same run: a plain read of the same file and a memcpy of its bytes. Then the same loads with
// a memory-streaming thread pinned to the loader's core, which is what a load meets on a
// one-core prefill tier (the engine's GEMMs stream weights): the served benchmark saw ~10x.
//
//   adapter_load_bench --model models/qwen2.5-0.5b-bf16 --adapters /tmp/ab_adapters [--count 32]
//
// The adapters are bench/adapter_bench's (lora-r16-<i>; made by it if absent).

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_util.h"
#include "common/adapters/adapter_loader.h"
#include "common/base/mapped_file.h"
#include "common/model/config.h"

namespace {

namespace fs = std::filesystem;
using preft::bench::Clock;
using preft::bench::Median;
using preft::bench::Seconds;

void PinToCpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

struct Timings {
  std::vector<double> read_ms, load_ms, memcpy_ms;
};

// Each adapter: read its safetensors alone, memcpy that many bytes, then the full load.
Timings Measure(const std::vector<std::string>& dirs, const preft::model::ModelConfig& config,
                const preft::adapters::LoadOptions& load) {
  Timings t;
  for (const std::string& dir : dirs) {
    auto t0 = Clock::now();
    auto file = preft::base::MappedFile::Read(dir + "/adapter_model.safetensors");
    auto t1 = Clock::now();
    if (!file.ok()) {
      std::fprintf(stderr, "adapter_load_bench: %s\n", file.status().ToString().c_str());
      std::exit(1);
    }
    std::vector<uint8_t> copy((*file)->size());
    auto t2 = Clock::now();
    std::memcpy(copy.data(), (*file)->data(), copy.size());
    auto t3 = Clock::now();
    file->reset();
    auto t4 = Clock::now();
    auto adapter = preft::adapters::LoadAdapter(dir, config, load);
    auto t5 = Clock::now();
    if (!adapter.ok()) {
      std::fprintf(stderr, "adapter_load_bench: %s\n", adapter.status().ToString().c_str());
      std::exit(1);
    }
    t.read_ms.push_back(1e3 * Seconds(t0, t1));
    t.memcpy_ms.push_back(1e3 * Seconds(t2, t3));
    t.load_ms.push_back(1e3 * Seconds(t4, t5));
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"one adapter load's cost, alone and next to a memory-streaming thread"};
  std::string model_dir, adapters_dir;
  int count = 32;
  bool neighbour_run = true;
  app.add_option("--model", model_dir, "base model folder (its config.json)")->required();
  app.add_option("--adapters", adapters_dir, "folder of lora-r16-<i> adapters")->required();
  app.add_option("--count", count, "adapters loaded per round")->check(CLI::PositiveNumber);
  app.add_flag("!--alone-only", neighbour_run, "skip the round next to a streaming thread (for perf)");
  CLI11_PARSE(app, argc, argv);

  auto config = preft::model::ModelConfig::FromFile(model_dir + "/config.json");
  if (!config.ok()) {
    std::fprintf(stderr, "adapter_load_bench: %s\n", config.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> dirs;
  for (int i = 0; i < count; ++i) {
    const std::string dir = adapters_dir + "/lora-r16-" + std::to_string(i);
    if (fs::exists(dir + "/adapter_config.json")) dirs.push_back(dir);
  }
  if (dirs.empty()) {
    std::fprintf(stderr, "adapter_load_bench: no lora-r16-<i> under %s (adapter_bench makes them)\n",
                 adapters_dir.c_str());
    return 1;
  }
  preft::adapters::LoadOptions load;
  load.dtype = config->torch_dtype;
  load.cpu_layout = true;
  const double mib = fs::file_size(dirs[0] + "/adapter_model.safetensors") / 1048576.0;

  PinToCpu(0);
  Measure(dirs, *config, load);  // warm: page cache, read buffers, allocator
  const Timings alone = Measure(dirs, *config, load);

  std::printf("adapter_load_bench: %zu adapters of %.1f MiB (%s, chunked CPU layout), medians\n",
              dirs.size(), mib, preft::kernels::DTypeName(load.dtype));
  std::printf("%-28s %9s %9s %9s %12s %12s\n", "", "read ms", "memcpy ms", "load ms",
              "load/read", "load/memcpy");
  auto row = [](const char* name, const Timings& t) {
    const double r = Median(t.read_ms), m = Median(t.memcpy_ms), l = Median(t.load_ms);
    std::printf("%-28s %9.2f %9.2f %9.2f %12.2f %12.2f\n", name, r, m, l, l / r, l / m);
  };
  row("alone on a core", alone);
  if (!neighbour_run) return 0;

  // A neighbour on the same core streaming 256 MiB arrays (like a GEMM reading weights).
  std::atomic<bool> stop{false};
  std::thread neighbour([&] {
    PinToCpu(0);
    const size_t n = (size_t{256} << 20) / sizeof(float);
    std::vector<float> a(n, 1.f), b(n, 2.f);
    while (!stop.load(std::memory_order_relaxed)) {
      for (size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * a[i];
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Timings shared = Measure(dirs, *config, load);
  stop = true;
  neighbour.join();

  row("next to a streaming thread", shared);
  std::printf("load next to a streaming thread / alone: %.2fx\n",
              Median(shared.load_ms) / Median(alone.load_ms));
  return 0;
}

// preft: one binary, one flag style. `preft --help` lists the subcommands.

#include <cstdio>

#include "CLI/CLI.hpp"
#include "tools/preft/commands.h"

#ifndef PREFT_HAVE_TRAIN
namespace preft::tools {
void RegisterTrainCommand(CLI::App& app, int* exit_code) {
  auto* train = app.add_subcommand("train", "Train adapters (this build has no libtorch)");
  train->allow_extras();
  train->callback([exit_code] {
    std::fprintf(stderr,
                 "preft train: this preft was built without the trainer (libtorch not found; "
                 "install libtorch-dev and rebuild, or PREFT_ENABLE_TRAIN=ON)\n");
    *exit_code = 1;
  });
}
}  // namespace preft::tools
#endif

int main(int argc, char** argv) {
  CLI::App app{"preft: serving prefill-only adapters (PreFT) and their baselines"};
  app.require_subcommand(1);
  int exit_code = 0;
  preft::tools::RegisterGenerateCommand(app, &exit_code);
  preft::tools::RegisterMakeModelCommand(app, &exit_code);
  preft::tools::RegisterMakeAdapterCommand(app, &exit_code);
  preft::tools::RegisterServeCommand(app, &exit_code);
  preft::tools::RegisterClientCommand(app, &exit_code);
  preft::tools::RegisterAdaptersCommand(app, &exit_code);
  preft::tools::RegisterBenchCommand(app, &exit_code);
  preft::tools::RegisterTrainCommand(app, &exit_code);
  preft::tools::RegisterTokenizeCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message; every usage error exits 2, --help exits 0.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return exit_code;
}

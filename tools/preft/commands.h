#pragma once

// Subcommands of the `preft` CLI. Each registers its flags and sets `*exit_code` when run.

#include "CLI/CLI.hpp"

namespace preft::tools {

void RegisterGenerateCommand(CLI::App& app, int* exit_code);
void RegisterMakeModelCommand(CLI::App& app, int* exit_code);
void RegisterMakeAdapterCommand(CLI::App& app, int* exit_code);
void RegisterServeCommand(CLI::App& app, int* exit_code);
void RegisterClientCommand(CLI::App& app, int* exit_code);
void RegisterAdaptersCommand(CLI::App& app, int* exit_code);
void RegisterBenchCommand(CLI::App& app, int* exit_code);
void RegisterTokenizeCommand(CLI::App& app, int* exit_code);
// `preft train`; without libtorch (PREFT_ENABLE_TRAIN=OFF) it only says so.
void RegisterTrainCommand(CLI::App& app, int* exit_code);

}  // namespace preft::tools

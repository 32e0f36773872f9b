#pragma once

// Shared by the trainer's tests: temp folders, tiny models made on the fly, JSONL files.

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/model/make_model.h"

namespace preft::train::testing {

// A fresh, empty folder for one test.
inline std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) /
             ("preft_train_test_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// make-model's `preset` in f32 (or `dtype`), made once per process and folder name.
inline std::string TinyModel(const std::string& preset = "tiny", uint64_t seed = 7,
                             kernels::DType dtype = kernels::DType::kF32) {
  const std::string dir =
      (std::filesystem::path(::testing::TempDir()) /
       ("preft_train_models_" + std::to_string(::getpid())) /
       (preset + "-" + std::to_string(seed) + (dtype == kernels::DType::kF32 ? "" : "-bf16")))
          .string();
  if (!std::filesystem::exists(dir + "/config.json")) {
    model::MakeModelOptions o;
    o.preset = preset;
    o.seed = seed;
    o.dtype = dtype;
    o.out_dir = dir;
    EXPECT_TRUE(model::MakeModel(o).ok()) << preset;
  }
  return dir;
}

inline std::string WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

}  // namespace preft::train::testing

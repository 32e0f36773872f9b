#pragma once

// Helpers for the adapter tests: temp folders, copies of the fixture adapters, and adapter
// folders built tensor by tensor.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/base/mapped_file.h"
#include "common/model/config.h"
#include "common/model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/fixtures.h"

namespace preft::adapters::testing {

using OrderedJson = nlohmann::ordered_json;

// A fresh, empty folder for one test.
inline std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) /
             ("preft_adapters_test_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline std::string FixtureAdapter(const std::string& name) {
  return preft::testing::TinyLlamaFixture() + "/" + name;
}

inline model::ModelConfig TinyConfig() {
  auto c = model::ModelConfig::FromFile(preft::testing::TinyLlamaFixture() + "/config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : model::ModelConfig{};
}

inline std::string ReadText(const std::string& path) {
  auto s = base::ReadFileToString(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : "";
}

inline void WriteText(const std::string& path, const std::string& text) {
  ASSERT_TRUE(base::WriteStringToFile(path, text).ok()) << path;
}

// Copies a fixture adapter into a writable temp folder (the fixtures are read-only).
inline std::string CopyFixture(const std::string& fixture, const std::string& name) {
  const std::string dir = TempDir(name);
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) {
    WriteText(dir + "/" + f, ReadText(FixtureAdapter(fixture) + "/" + f));
  }
  return dir;
}

inline OrderedJson ReadConfig(const std::string& dir) {
  return OrderedJson::parse(ReadText(dir + "/adapter_config.json"));
}

inline void WriteConfig(const std::string& dir, const OrderedJson& j) {
  WriteText(dir + "/adapter_config.json", j.dump(1));
}

inline void EditConfig(const std::string& dir, const std::function<void(OrderedJson&)>& edit) {
  OrderedJson j = ReadConfig(dir);
  edit(j);
  WriteConfig(dir, j);
}

// A tensor held as f32 values (written in `dtype`).
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  kernels::DType dtype = kernels::DType::kF32;
};

inline std::vector<Tensor> ReadTensors(const std::string& dir) {
  std::vector<Tensor> out;
  auto file = model::SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const auto& [name, t] : (*file)->tensors()) {
    Tensor x{name, t.shape, {}, t.dtype};
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      x.values.push_back(kernels::LoadAsF32(t.data, t.dtype, i));
    }
    out.push_back(std::move(x));
  }
  return out;
}

inline void WriteTensors(const std::string& dir, const std::vector<Tensor>& tensors) {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<model::TensorToWrite> specs;
  for (const Tensor& t : tensors) {
    std::vector<uint8_t> b(t.values.size() * kernels::DTypeSize(t.dtype));
    for (size_t i = 0; i < t.values.size(); ++i) {
      if (t.dtype == kernels::DType::kF32) {
        std::memcpy(b.data() + 4 * i, &t.values[i], 4);
      } else {
        const uint16_t h = t.dtype == kernels::DType::kBF16 ? kernels::F32ToBf16(t.values[i])
                                                            : kernels::F32ToF16(t.values[i]);
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
    }
    bytes.push_back(std::move(b));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    specs.push_back({tensors[i].name, tensors[i].dtype, tensors[i].shape, bytes[i].data()});
  }
  ASSERT_TRUE(
      model::WriteSafetensors(dir + "/adapter_model.safetensors", specs, {{"format", "pt"}}).ok());
}

// Values i * step + offset, distinct per tensor so mix-ups show.
inline Tensor Ramp(const std::string& name, std::vector<int64_t> shape, float offset) {
  Tensor t{name, shape, {}};
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  for (int64_t i = 0; i < n; ++i) t.values.push_back(offset + 0.001f * static_cast<float>(i));
  return t;
}

// The f32 value of element (r, c) of a [rows, cols] matrix view.
inline float At(const kernels::MatrixView& m, int64_t r, int64_t c) {
  return kernels::LoadAsF32(m.data, m.dtype, r * m.cols + c);
}

}  // namespace preft::adapters::testing

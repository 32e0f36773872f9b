#pragma once

// The tiny-llama fixture model and tokenizer, loaded once per suite, and engines on it.

#include <gtest/gtest.h>

#include <memory>

#include "common/engine/engine.h"
#include "tests/testing/fixtures.h"

namespace preft::engine {

class TinyEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (model_ != nullptr) return;  // shared by every suite of the binary
    auto m = model::Model::Load(testing::TinyLlamaFixture());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(m).value().release();
    auto t = text::Tokenizer::LoadFromModelDir(testing::TinyLlamaFixture());
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = std::move(t).value().release();
  }

  static std::unique_ptr<Engine> MakeEngine(int64_t kv_blocks, int64_t batch_tokens = 512,
                                            kv::KvDtype kv_dtype = kv::KvDtype::kF32) {
    EngineOptions o;
    o.kv_blocks = kv_blocks;
    o.kv_dtype = kv_dtype;
    o.scheduler.max_batch_tokens = batch_tokens;
    return MakeEngine(o);
  }
  static std::unique_ptr<Engine> MakeEngine(const EngineOptions& options) {
    auto e = Engine::Create(model_, tokenizer_, options);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  }

  static inline model::Model* model_ = nullptr;
  static inline text::Tokenizer* tokenizer_ = nullptr;
};

}  // namespace preft::engine

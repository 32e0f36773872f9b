#include "services/router/adapter_registry.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "services/router/registry_postgres.h"
#include "tests/testing/fixtures.h"
#include "tests/testing/postgres_server.h"

namespace preft::router {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every test runs against both stores: the files in the adapter root, and a real PostgreSQL
// server (started once, tables dropped before each test).
class AdapterRegistryTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void TearDownTestSuite() { postgres_.reset(); }

  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("registry_root_" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    fs::copy(testing::TinyLlamaFixture() + "/lora", root_ / "lora");
    fs::copy(testing::TinyLlamaFixture() + "/direft", root_ / "direft");
    if (GetParam() == "postgres") {
      if (postgres_ == nullptr) {
        auto pg = testing::PostgresServer::Start(
            (fs::path(::testing::TempDir()) / ("registry_pg_" + std::to_string(getpid()))).string());
        if (absl::IsNotFound(pg.status())) GTEST_SKIP() << pg.status();
        ASSERT_TRUE(pg.ok()) << pg.status();
        postgres_ = *std::move(pg);
      }
      ASSERT_TRUE(postgres_->Sql("DROP TABLE IF EXISTS preft_adapter_versions, preft_adapter_preload"));
    }
    registry_ = MakeRegistry();
    ASSERT_NE(registry_, nullptr);
  }

  // Another router on the same store (or the same one restarted).
  std::unique_ptr<AdapterRegistry> MakeRegistry(const std::string& root = "") {
    auto c = model::ModelConfig::FromFile(testing::TinyLlamaFixture() + "/config.json");
    EXPECT_TRUE(c.ok());
    std::unique_ptr<RegistryStore> store;
    if (GetParam() == "postgres") {
      auto pg = PostgresRegistryStore::Connect(postgres_->Uri());
      EXPECT_TRUE(pg.ok()) << pg.status();
      if (!pg.ok()) return nullptr;
      store = *std::move(pg);
    }
    return std::make_unique<AdapterRegistry>(*c, "tiny", root.empty() ? root_.string() : root,
                                             adapters::LoadOptions{}, std::move(store));
  }

  static std::unique_ptr<testing::PostgresServer> postgres_;
  fs::path root_;
  std::unique_ptr<AdapterRegistry> registry_;
};

std::unique_ptr<testing::PostgresServer> AdapterRegistryTest::postgres_;

TEST_P(AdapterRegistryTest, RegistersValidatedAdaptersAtVersionOne) {
  auto a = registry_->Register("user-1", "lora");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->version, 1);
  EXPECT_EQ(a->kind, model::AdapterKind::kLora);
  EXPECT_GT(a->rank, 0);
  EXPECT_GT(a->bytes, 0);
  auto d = registry_->Register("user-2", (root_ / "direft").string());  // absolute, inside
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kind, model::AdapterKind::kDireft);
  EXPECT_EQ(registry_->List()->size(), 2u);
  EXPECT_EQ(registry_->Register("user-1", "lora").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry_->Get("nobody").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry_->Unregister("user-1").ok());
  EXPECT_EQ(registry_->Unregister("user-1").code(), absl::StatusCode::kNotFound);
}

TEST_P(AdapterRegistryTest, RefusesPathsOutsideTheRootBadNamesAndBadAdapters) {
  auto outside = registry_->Register("x", testing::TinyLlamaFixture() + "/lora");
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("outside the adapter root"), std::string::npos)
      << outside.status();
  EXPECT_EQ(registry_->Register("x", "../registry_root/../..").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Outside and absent is still "outside", not NotFound: the answer must not depend on (or
  // reveal) what exists beyond the root.
  auto absent = registry_->Register("x", "../../../../../../../../../../no-such-preft-dir");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kInvalidArgument) << absent.status();
  EXPECT_EQ(registry_->Register("x", "/no-such-preft-dir").status().code(),
            absl::StatusCode::kInvalidArgument);
  fs::create_directory_symlink(fs::path(testing::TinyLlamaFixture()) / "lora", root_ / "escape");
  EXPECT_EQ(registry_->Register("x", "escape").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->Register("x", "missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_->Register("bad/name", "lora").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->Register("", "lora").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->Register("tiny", "lora").status().code(), absl::StatusCode::kInvalidArgument);
  fs::create_directories(root_ / "broken");
  std::ofstream(root_ / "broken" / "adapter_config.json") << "{not json";
  EXPECT_FALSE(registry_->Register("broken", "broken").ok());
  EXPECT_TRUE(registry_->List()->empty());
}

TEST_P(AdapterRegistryTest, UpdateWritesANewValidatedVersion) {
  auto v1 = registry_->Register("u", "lora");
  ASSERT_TRUE(v1.ok());
  const std::map<std::string, std::string> files = {
      {"adapter_config.json", ReadFile(root_ / "lora" / "adapter_config.json")},
      {"adapter_model.safetensors", ReadFile(root_ / "lora" / "adapter_model.safetensors")}};
  auto v2 = registry_->Update("u", 1, files);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->version, 2);
  EXPECT_NE(v2->path, v1->path);  // the old version's folder stays for requests still on it
  EXPECT_TRUE(fs::exists(fs::path(v2->path) / "adapter_model.safetensors"));
  EXPECT_EQ(registry_->Get("u")->version, 2);
  EXPECT_EQ(registry_->Get("u")->registered_path, "lora");
  // A stale expected version, a bad file set or a path in a name changes nothing.
  EXPECT_EQ(registry_->Update("u", 1, files).status().code(), absl::StatusCode::kFailedPrecondition);
  auto truncated = files;
  truncated["adapter_model.safetensors"].resize(100);
  EXPECT_FALSE(registry_->Update("u", std::nullopt, truncated).ok());
  EXPECT_EQ(registry_->Update("u", std::nullopt, {{"../x", "y"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->Get("u")->version, 2);
  EXPECT_EQ(registry_->Update("nobody", std::nullopt, files).status().code(),
            absl::StatusCode::kNotFound);
}

// Nothing under the root may reach outside it through its files, paths carry no control
// characters, and errors name paths as the client gave them, never the server's.
TEST_P(AdapterRegistryTest, RefusesLinkedFilesAndControlCharactersAndHidesServerPaths) {
  fs::create_directories(root_ / "linked");
  fs::copy(root_ / "lora" / "adapter_model.safetensors", root_ / "linked");
  fs::create_symlink(root_ / "lora" / "adapter_config.json", root_ / "linked" / "adapter_config.json");
  auto linked = registry_->Register("linked", "linked");
  ASSERT_FALSE(linked.ok());
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(linked.status().message().find("adapter_config.json is a symbolic link"),
            std::string::npos) << linked.status();
  for (const std::string& bad : {std::string("lora\0x", 6), std::string("lo\x01ra"), std::string("lora\n")}) {
    auto r = registry_->Register("c", bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("control character"), std::string::npos) << r.status();
  }
  auto outside = registry_->Register("o", "../..");
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.status().message().find(root_.parent_path().string()), std::string::npos)
      << outside.status();
  // A truncated file is the client's bad input, named relative to the root.
  fs::create_directories(root_ / "truncated");
  fs::copy(root_ / "lora" / "adapter_config.json", root_ / "truncated");
  std::ofstream(root_ / "truncated" / "adapter_model.safetensors")
      << ReadFile(root_ / "lora" / "adapter_model.safetensors").substr(0, 200);
  auto truncated = registry_->Register("t", "truncated");
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kInvalidArgument) << truncated.status();
  EXPECT_EQ(truncated.status().message().find(root_.string()), std::string::npos)
      << truncated.status();
  EXPECT_NE(truncated.status().message().find("truncated/adapter_model.safetensors"),
            std::string::npos) << truncated.status();
  // An update's files are named as the update, not as the server's versions folder.
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  auto bad_update = registry_->Update(
      "u", 1, {{"adapter_config.json", ReadFile(root_ / "lora" / "adapter_config.json")},
               {"adapter_model.safetensors", "garbage"}});
  ASSERT_FALSE(bad_update.ok());
  EXPECT_EQ(bad_update.status().message().find(".preft-versions"), std::string::npos)
      << bad_update.status();
}

// A server started with a relative --adapter-root (`preft serve --adapter-root
// models/adapters`) stores updates under that root once, not under root/root.
TEST_P(AdapterRegistryTest, UpdateUnderARelativeRoot) {
  const fs::path cwd = fs::current_path();
  fs::current_path(root_.parent_path());
  std::unique_ptr<AdapterRegistry> relative = MakeRegistry(root_.filename().string());
  ASSERT_TRUE(relative->Register("u", "lora").ok());
  const std::map<std::string, std::string> files = {
      {"adapter_config.json", ReadFile(root_ / "lora" / "adapter_config.json")},
      {"adapter_model.safetensors", ReadFile(root_ / "lora" / "adapter_model.safetensors")}};
  auto v2 = relative->Update("u", 1, files);
  fs::current_path(cwd);
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->version, 2);
  EXPECT_TRUE(fs::exists(fs::path(v2->path) / "adapter_model.safetensors"));
  EXPECT_EQ(fs::path(v2->path).parent_path(), fs::canonical(root_) / ".preft-versions" / "u");
}

// The registry lives in the adapter root: a restarted router (a new registry on the same root)
// finds every adapter at its version, and a removal by one router is seen by another->
TEST_P(AdapterRegistryTest, RegistrationsAndVersionsSurviveARestart) {
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  ASSERT_TRUE(registry_->Register("d", "direft").ok());
  const std::map<std::string, std::string> files = {
      {"adapter_config.json", ReadFile(root_ / "lora" / "adapter_config.json")},
      {"adapter_model.safetensors", ReadFile(root_ / "lora" / "adapter_model.safetensors")}};
  auto v2 = registry_->Update("u", 1, files);
  ASSERT_TRUE(v2.ok()) << v2.status();
  registry_.reset();  // the router goes away
  std::unique_ptr<AdapterRegistry> restarted = MakeRegistry();
  auto u = restarted->Get("u");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->version, 2);
  EXPECT_EQ(u->path, v2->path);
  EXPECT_EQ(u->registered_path, "lora");
  EXPECT_EQ(u->kind, model::AdapterKind::kLora);
  auto d = restarted->Get("d");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind, model::AdapterKind::kDireft);
  EXPECT_EQ(restarted->List()->size(), 2u);
  EXPECT_EQ(restarted->Register("u", "lora").status().code(), absl::StatusCode::kAlreadyExists);
  std::unique_ptr<AdapterRegistry> other = MakeRegistry();
  ASSERT_TRUE(other->Unregister("d").ok());
  EXPECT_EQ(restarted->Get("d").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(restarted->Register("d", "direft").ok());  // the name is free again
}

// A record whose fields have other JSON types (a hand-edited or damaged file) is reported,
// never thrown on (json::value would throw), whichever field it is.
TEST_P(AdapterRegistryTest, ARecordWithFieldsOfTheWrongTypeIsReportedNotThrown) {
  if (GetParam() != "file") GTEST_SKIP() << "records are rows in PostgreSQL";
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  const fs::path record = root_ / ".preft-registry" / "u" / "v1.json";
  ASSERT_TRUE(fs::exists(record));
  for (const char* bad : {R"({"path": "lora", "rank": "four"})", R"({"path": "lora", "kind": 1})",
                          R"({"path": "lora", "registered_path": []})",
                          R"({"path": "lora", "default_positions": {}})",
                          R"({"path": "lora", "bytes": 1.5})", R"({"path": 7})"}) {
    std::ofstream(record, std::ios::trunc) << bad;
    std::unique_ptr<AdapterRegistry> restarted = MakeRegistry();
    const absl::StatusOr<RegisteredAdapter> u = restarted->Get("u");
    EXPECT_FALSE(u.ok()) << bad;
    EXPECT_NE(u.status().message().find("unreadable"), std::string::npos) << u.status();
  }
}

// Which adapters are preloaded is kept with the registry: another router (or a restarted one)
// knows which to load onto a worker that rejoins.
TEST_P(AdapterRegistryTest, PreloadMarksAreSharedAndGoWithTheAdapter) {
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  ASSERT_TRUE(registry_->Register("d", "direft").ok());
  EXPECT_EQ(registry_->SetPreload("nobody", true).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry_->SetPreload("u", true).ok());
  ASSERT_TRUE(registry_->SetPreload("u", true).ok());  // idempotent
  std::unique_ptr<AdapterRegistry> other = MakeRegistry();
  EXPECT_EQ(*other->Preloaded(), std::vector<std::string>{"u"});
  ASSERT_TRUE(other->SetPreload("d", true).ok());
  ASSERT_TRUE(other->SetPreload("u", false).ok());
  EXPECT_EQ(*registry_->Preloaded(), std::vector<std::string>{"d"});
  ASSERT_TRUE(registry_->Unregister("d").ok());
  EXPECT_TRUE(other->Preloaded()->empty());
}

// Two routers sharing the root, each sent UpdateAdapter(expected_version = v) at once: exactly
// one makes v + 1, the other gets FAILED_PRECONDITION, round after round.
TEST_P(AdapterRegistryTest, TwoRoutersRacingForAVersionExactlyOneWins) {
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  std::unique_ptr<AdapterRegistry> second = MakeRegistry();
  const std::map<std::string, std::string> files = {
      {"adapter_config.json", ReadFile(root_ / "lora" / "adapter_config.json")},
      {"adapter_model.safetensors", ReadFile(root_ / "lora" / "adapter_model.safetensors")}};
  for (int64_t v = 1; v <= 6; ++v) {
    absl::StatusOr<RegisteredAdapter> a, b;
    std::thread ta([&] { a = registry_->Update("u", v, files); });
    std::thread tb([&] { b = second->Update("u", v, files); });
    ta.join();
    tb.join();
    ASSERT_NE(a.ok(), b.ok()) << "round " << v << ": " << a.status() << " / " << b.status();
    const absl::Status& lost = a.ok() ? b.status() : a.status();
    EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
    EXPECT_EQ((a.ok() ? a : b)->version, v + 1);
    EXPECT_EQ(registry_->Get("u")->version, v + 1);
    EXPECT_EQ(second->Get("u")->version, v + 1);
  }
  // Only the winners' folders remain.
  int folders = 0;
  for (const auto& e : fs::directory_iterator(root_ / ".preft-versions" / "u")) folders += e.is_directory();
  EXPECT_EQ(folders, 6);
}

// A database that goes away makes lookups UNAVAILABLE (never "not registered"), and the store
// reconnects by itself once it is back.
TEST_P(AdapterRegistryTest, ADatabaseRestartIsUnavailableThenHeals) {
  if (GetParam() != "postgres") GTEST_SKIP() << "the file store has no server";
  ASSERT_TRUE(registry_->Register("u", "lora").ok());
  postgres_->Stop();
  const auto down = registry_->Get("u");
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  EXPECT_EQ(down.status().message().find("postgresql://"), std::string::npos) << down.status();
  ASSERT_TRUE(postgres_->Restart());
  const auto up = registry_->Get("u");
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->version, 1);
}

INSTANTIATE_TEST_SUITE_P(Stores, AdapterRegistryTest, ::testing::Values("file", "postgres"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace preft::router

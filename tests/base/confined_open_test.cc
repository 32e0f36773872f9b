// OpenBeneath, by openat2 and by the component walk: what lies beneath opens; links, escapes,
// FIFOs and the wrong kind are refused with the right code, and nothing blocks.

#include "common/base/confined_open.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace preft::base {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class ConfinedOpenTest : public ::testing::TestWithParam<BeneathResolver> {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("confined_" + std::to_string(::getpid()) + "_" +
            std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "root" / "a" / "b");
    fs::create_directories(dir_ / "outside");
    std::ofstream(dir_ / "root" / "a" / "b" / "file") << "inside";
    std::ofstream(dir_ / "outside" / "secret") << "secret";
    absl::StatusOr<Fd> root = OpenFolder((dir_ / "root").string());
    ASSERT_TRUE(root.ok()) << root.status();
    root_ = *std::move(root);
  }
  void TearDown() override { fs::remove_all(dir_); }

  absl::StatusOr<Fd> Open(const std::string& relative, OpenKind kind = OpenKind::kRegularFile) {
    return OpenBeneath(root_.get(), relative, kind, GetParam());
  }
  void ExpectRefused(const std::string& relative, absl::StatusCode code, const std::string& why,
                     OpenKind kind = OpenKind::kRegularFile) {
    SCOPED_TRACE(relative);
    absl::StatusOr<Fd> fd = Open(relative, kind);
    ASSERT_FALSE(fd.ok());
    EXPECT_EQ(fd.status().code(), code) << fd.status();
    EXPECT_THAT(fd.status().message(), HasSubstr(why));
    EXPECT_THAT(fd.status().message(), HasSubstr(relative));
  }

  fs::path dir_;
  Fd root_;
};

TEST_P(ConfinedOpenTest, OpensWhatLiesBeneath) {
  absl::StatusOr<Fd> fd = Open("a/b/file");
  ASSERT_TRUE(fd.ok()) << fd.status();
  char buf[16] = {};
  ASSERT_EQ(::read(fd->get(), buf, sizeof(buf)), 6);
  EXPECT_STREQ(buf, "inside");
  EXPECT_TRUE(Open("a/b", OpenKind::kFolder).ok());
}

TEST_P(ConfinedOpenTest, RefusesLinksEscapesAndTheWrongKind) {
  // A link to a file inside the root is refused too: the rule is "no link", not "no link out".
  fs::create_symlink(dir_ / "root" / "a" / "b" / "file", dir_ / "root" / "a" / "inner_link");
  fs::create_symlink(dir_ / "outside" / "secret", dir_ / "root" / "a" / "outer_link");
  fs::create_directory_symlink(dir_ / "outside", dir_ / "root" / "dirlink");
  ExpectRefused("a/inner_link", absl::StatusCode::kInvalidArgument, "symbolic link");
  ExpectRefused("a/outer_link", absl::StatusCode::kInvalidArgument, "symbolic link");
  ExpectRefused("dirlink/secret", absl::StatusCode::kInvalidArgument, "symbolic link");
  // openat2 says "leads outside" (EXDEV); the walk refuses ".." by the same code.
  ExpectRefused("a/../../outside/secret", absl::StatusCode::kInvalidArgument, "outside");
  ExpectRefused("/etc/passwd", absl::StatusCode::kInvalidArgument, "not a relative path");
  ExpectRefused("a/missing", absl::StatusCode::kNotFound, "No such file");
  ExpectRefused("a/b", absl::StatusCode::kInvalidArgument, "not a regular file");
  ExpectRefused("a/b/file", absl::StatusCode::kInvalidArgument, "not a folder", OpenKind::kFolder);
}

TEST_P(ConfinedOpenTest, AFifoIsRefusedWithoutWaitingForAWriter) {
  ASSERT_EQ(::mkfifo((dir_ / "root" / "a" / "fifo").c_str(), 0600), 0);
  ExpectRefused("a/fifo", absl::StatusCode::kInvalidArgument, "not a regular file");
}

INSTANTIATE_TEST_SUITE_P(Resolvers, ConfinedOpenTest,
                         ::testing::Values(BeneathResolver::kAuto, BeneathResolver::kWalk),
                         [](const auto& info) {
                           return info.param == BeneathResolver::kAuto ? "Openat2" : "Walk";
                         });

}  // namespace
}  // namespace preft::base

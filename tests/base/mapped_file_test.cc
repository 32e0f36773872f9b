#include "common/base/mapped_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace preft::base {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/mapped_file_test_" + std::to_string(::getpid()) + "_" + name;
}

// Bytes that differ at every offset of a 4 KiB page and from page to page.
std::string Pattern(size_t size) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>((i * 2654435761u) >> 13);
  return s;
}

TEST(MappedFileTest, SmallFileReadsBack) {
  const std::string path = TempPath("small"), want = Pattern(10'000);
  ASSERT_TRUE(WriteStringToFile(path, want).ok());
  auto file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->size(), want.size());
  EXPECT_EQ(std::memcmp((*file)->data(), want.data(), want.size()), 0);
  EXPECT_EQ((*file)->path(), path);
  ::unlink(path.c_str());
}

// Weight-sized files take the huge-page path (page cache dropped, mapping advised and
// populated): the bytes must be the file's, whether or not the kernel gave huge pages.
TEST(MappedFileTest, LargeFileReadsBackThroughTheHugePagePath) {
  const std::string path = TempPath("large");
  const std::string want = Pattern((size_t{80} << 20) + 12'345);  // not a whole page
  ASSERT_TRUE(WriteStringToFile(path, want).ok());
  auto file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->size(), want.size());
  EXPECT_EQ(std::memcmp((*file)->data(), want.data(), want.size()), 0);
  EXPECT_LE((*file)->HugePageBytes(), want.size());
  ::unlink(path.c_str());
}

TEST(MappedFileTest, EmptyFileHasNoData) {
  const std::string path = TempPath("empty");
  ASSERT_TRUE(WriteStringToFile(path, "").ok());
  auto file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->size(), 0u);
  EXPECT_EQ((*file)->data(), nullptr);
  EXPECT_EQ((*file)->HugePageBytes(), 0u);
  ::unlink(path.c_str());
}

TEST(MappedFileTest, BadPathsAreNamedInTheError) {
  const std::string missing = TempPath("missing");
  auto file = MappedFile::Open(missing);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find(missing), std::string::npos) << file.status();

  auto dir = MappedFile::Open(::testing::TempDir());
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dir.status().message().find("not a regular file"), std::string::npos)
      << dir.status();
}

}  // namespace
}  // namespace preft::base

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

// Read copies instead of mapping, into buffers reused from earlier Reads: a later, smaller
// file must read back as itself, and images alive together must not share bytes.
TEST(MappedFileTest, ReadCopiesTheFileAndReusesNoStaleBytes) {
  const std::string big = TempPath("read_big"), small = TempPath("read_small");
  const std::string want_big = Pattern(300'000), want_small(5'000, 'x');
  ASSERT_TRUE(WriteStringToFile(big, want_big).ok());
  ASSERT_TRUE(WriteStringToFile(small, want_small).ok());
  for (int round = 0; round < 3; ++round) {
    auto a = MappedFile::Read(big);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ((*a)->size(), want_big.size());
    EXPECT_EQ(std::memcmp((*a)->data(), want_big.data(), want_big.size()), 0);
    EXPECT_EQ((*a)->HugePageBytes(), 0u);
    a->reset();  // its buffer goes back for the next Read
    auto b = MappedFile::Read(small);
    auto c = MappedFile::Read(big);
    ASSERT_TRUE(b.ok() && c.ok());
    ASSERT_EQ((*b)->size(), want_small.size());
    EXPECT_EQ(std::memcmp((*b)->data(), want_small.data(), want_small.size()), 0);
    EXPECT_EQ(std::memcmp((*c)->data(), want_big.data(), want_big.size()), 0);
    EXPECT_NE((*b)->data(), (*c)->data());
  }
  auto empty_path = TempPath("read_empty");
  ASSERT_TRUE(WriteStringToFile(empty_path, "").ok());
  auto empty = MappedFile::Read(empty_path);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ((*empty)->size(), 0u);
  EXPECT_EQ((*empty)->data(), nullptr);
  for (const auto& p : {big, small, empty_path}) ::unlink(p.c_str());
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

  auto read_missing = MappedFile::Read(missing);
  EXPECT_EQ(read_missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read_missing.status().message().find(missing), std::string::npos);
  EXPECT_EQ(MappedFile::Read(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace preft::base

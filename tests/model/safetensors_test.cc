#include "common/model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/base/mapped_file.h"

namespace preft::model {
namespace {

using kernels::DType;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("preft_safetensors_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

// A file image: 8-byte LE length, `header` verbatim, then `data_bytes` zero bytes.
std::string Image(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data_bytes, '\0');
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> ParseImage(const std::string& image) {
  return SafetensorsFile::Parse("mem.safetensors", reinterpret_cast<const uint8_t*>(image.data()),
                                image.size());
}

// Writes `image` to a file named `name` and opens it, so messages can be checked for the path.
absl::StatusOr<std::unique_ptr<SafetensorsFile>> OpenImage(const std::string& name,
                                                           const std::string& image) {
  std::string path = TempPath(name);
  EXPECT_TRUE(base::WriteStringToFile(path, image).ok());
  return SafetensorsFile::Open(path);
}

TEST(SafetensorsTest, WriteThenOpenRoundTrips) {
  std::vector<float> a = {1.f, -2.f, 3.5f, 0.25f, 7.f, 8.f};
  std::vector<uint16_t> b = {kernels::F32ToBf16(1.5f), kernels::F32ToBf16(-0.75f)};
  std::vector<uint16_t> c = {kernels::F32ToF16(0.5f)};
  std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"z.weight", DType::kF32, {2, 3}, a.data()},
                                {"a.bias", DType::kBF16, {2}, b.data()},
                                {"m.scalar", DType::kF16, {}, c.data()}},
                               {{"format", "pt"}})
                  .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), 3u);
  const TensorInfo* z = (*f)->Find("z.weight");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->dtype, DType::kF32);
  EXPECT_EQ(z->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(z->num_bytes, 24u);
  EXPECT_EQ(z->file, path);
  EXPECT_EQ(std::memcmp(z->data, a.data(), 24), 0);
  const TensorInfo* bias = (*f)->Find("a.bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->dtype, DType::kBF16);
  EXPECT_FLOAT_EQ(kernels::LoadAsF32(bias->data, bias->dtype, 1), -0.75f);
  const TensorInfo* scalar = (*f)->Find("m.scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_EQ(scalar->num_elements(), 1);
  EXPECT_FLOAT_EQ(kernels::LoadAsF32(scalar->data, DType::kF16, 0), 0.5f);
  EXPECT_EQ((*f)->Find("missing"), nullptr);
}

TEST(SafetensorsTest, HeaderIsPaddedToEightBytesAndSortedByName) {
  std::vector<float> x = {1.f};
  std::string path = TempPath("padded.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"b", DType::kF32, {1}, x.data()}, {"a", DType::kF32, {1}, x.data()}})
          .ok());
  auto text = base::ReadFileToString(path);
  ASSERT_TRUE(text.ok());
  uint64_t n = 0;
  std::memcpy(&n, text->data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(text->size(), 8 + n + 8);
  std::string header = text->substr(8, n);
  EXPECT_LT(header.find("\"a\""), header.find("\"b\""));
  EXPECT_EQ(header.back() == ' ' || header.back() == '}', true);
  // "a" sorts first, so it owns data bytes [0, 4).
  EXPECT_THAT(header, HasSubstr("\"a\":{\"data_offsets\":[0,4]"));
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  std::vector<float> x = {1.f, 2.f};
  EXPECT_EQ(WriteSafetensors(TempPath("dup.safetensors"),
                             {{"a", DType::kF32, {1}, x.data()}, {"a", DType::kF32, {1}, x.data()}})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      WriteSafetensors(TempPath("neg.safetensors"), {{"a", DType::kF32, {-1}, x.data()}}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      WriteSafetensors(TempPath("null.safetensors"), {{"a", DType::kF32, {2}, nullptr}}).code(),
      absl::StatusCode::kInvalidArgument);
  auto w = SafetensorsWriter::Create(TempPath("stream.safetensors"),
                                     {{"a", DType::kF32, {2}}, {"b", DType::kF32, {1}}});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->Append(x.data(), 4).code(), absl::StatusCode::kInvalidArgument);  // needs 8
  ASSERT_TRUE((*w)->Append(x.data(), 8).ok());
  absl::Status early = (*w)->Close();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("'b'"));
}

TEST(SafetensorsTest, EmptyFileIsTruncated) {
  auto f = OpenImage("empty.safetensors", "");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), AllOf(HasSubstr("empty.safetensors"), HasSubstr("too short")));
  auto g = OpenImage("five.safetensors", "abcde");
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDataLoss);
}

TEST(SafetensorsTest, HeaderLengthLargerThanFile) {
  std::string image = Image("{}", 0);
  image[0] = 100;  // claims a 100-byte header; 2 bytes follow
  auto f = OpenImage("biglen.safetensors", image);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("biglen.safetensors"), HasSubstr("header length 100")));
  std::string huge = Image("{}", 0);
  for (int i = 0; i < 8; ++i) huge[i] = '\xff';  // 2^64-1: must not wrap around
  EXPECT_EQ(ParseImage(huge).status().code(), absl::StatusCode::kDataLoss);
}

TEST(SafetensorsTest, TruncatedDataSection) {
  std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  auto f = OpenImage("cut.safetensors", Image(header, 10));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("cut.safetensors"), HasSubstr("'w'"), HasSubstr("truncated")));
}

TEST(SafetensorsTest, HeaderNotJson) {
  auto f = OpenImage("notjson.safetensors", Image("{\"w\": [1, 2", 0));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("notjson.safetensors"), HasSubstr("not valid JSON")));
  auto g = ParseImage(Image("[1, 2, 3]", 0));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(), HasSubstr("not a JSON object"));
  auto deep = ParseImage(Image(std::string(5000, '[') + std::string(5000, ']'), 0));
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, SpanDisagreesWithShape) {
  std::string header = R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})";
  auto f = OpenImage("span.safetensors", Image(header, 24));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), AllOf(HasSubstr("span.safetensors"), HasSubstr("'w'"),
                                          HasSubstr("needs 24 bytes"), HasSubstr("span 20")));
}

TEST(SafetensorsTest, OffsetsOutOfOrderOrOverlapping) {
  auto reversed =
      ParseImage(Image(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 16));
  EXPECT_EQ(reversed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reversed.status().message(), HasSubstr("end before begin"));

  std::string header = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  auto f = OpenImage("overlap.safetensors", Image(header, 16));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), AllOf(HasSubstr("overlap.safetensors"), HasSubstr("'a'"),
                                          HasSubstr("'b'"), HasSubstr("overlap")));

  auto negative =
      ParseImage(Image(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 16));
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("data_offsets"));
}

TEST(SafetensorsTest, NegativeOrNonIntegerDimensions) {
  auto f = OpenImage("negdim.safetensors",
                     Image(R"({"w":{"dtype":"F32","shape":[-2,3],"data_offsets":[0,0]}})", 0));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), AllOf(HasSubstr("negdim.safetensors"), HasSubstr("'w'"),
                                          HasSubstr("invalid dimension -2")));
  auto g = ParseImage(Image(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, ShapeProductOverflow) {
  // 2^32 * 2^32 elements wraps to 0 in 64 bits; the span [0, 0] must not be accepted.
  auto f = OpenImage(
      "overflow.safetensors",
      Image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("overflow.safetensors"), HasSubstr("'w'"), HasSubstr("overflows")));
}

TEST(SafetensorsTest, UnsupportedDtypeNamesTensorAndDtype) {
  auto f =
      OpenImage("ids.safetensors",
                Image(R"({"position_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(),
              AllOf(HasSubstr("ids.safetensors"), HasSubstr("'position_ids'"), HasSubstr("I64")));
}

TEST(SafetensorsTest, MalformedEntries) {
  for (const char* header : {
           R"({"w":{"shape":[1],"data_offsets":[0,4]}})",              // no dtype
           R"({"w":{"dtype":"F32","data_offsets":[0,4]}})",            // no shape
           R"({"w":{"dtype":"F32","shape":[1]}})",                     // no offsets
           R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",  // one offset
           R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})",    // dtype not a string
           R"({"w":[1,2,3]})",                                         // not an object
           R"({"__metadata__":{"format":1}})",                         // metadata not string
           R"({"__metadata__":[]})",
       }) {
    auto f = ParseImage(Image(header, 4));
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << header;
    EXPECT_THAT(f.status().message(), HasSubstr("mem.safetensors")) << header;
  }
}

TEST(SafetensorsTest, EmptyHeaderAndZeroSizedTensorsAreFine) {
  auto f = ParseImage(Image("{}", 0));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->tensors().empty());
  auto g = ParseImage(Image(R"({"e":{"dtype":"BF16","shape":[0,5],"data_offsets":[0,0]},)"
                            R"("w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}   )",
                            4));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->tensors().size(), 2u);
}

TEST(SafetensorsTest, OpensReferenceFixture) {
  std::string path = std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama/model.safetensors";
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorInfo* embed = (*f)->Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->dtype, DType::kF32);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{300, 64}));
  EXPECT_EQ((*f)->size_bytes(), std::filesystem::file_size(path));
}

// Read (adapters) copies the file instead of mapping it: the same tensors, bytes and errors.
TEST(SafetensorsTest, ReadMatchesOpen) {
  std::string path = std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama/model.safetensors";
  auto mapped = SafetensorsFile::Open(path);
  auto read = SafetensorsFile::Read(path);
  ASSERT_TRUE(mapped.ok() && read.ok()) << read.status();
  ASSERT_EQ((*read)->tensors().size(), (*mapped)->tensors().size());
  for (const auto& [name, t] : (*mapped)->tensors()) {
    const TensorInfo* r = (*read)->Find(name);
    ASSERT_NE(r, nullptr) << name;
    EXPECT_EQ(r->shape, t.shape);
    EXPECT_EQ(r->dtype, t.dtype);
    ASSERT_EQ(r->num_bytes, t.num_bytes);
    EXPECT_NE(r->data, t.data);
    EXPECT_EQ(std::memcmp(r->data, t.data, t.num_bytes), 0) << name;
  }
  std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  std::string cut = TempPath("cut_read.safetensors");
  ASSERT_TRUE(base::WriteStringToFile(cut, Image(header, 10)).ok());
  auto f = SafetensorsFile::Read(cut);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f.status().message(), AllOf(HasSubstr("cut_read.safetensors"), HasSubstr("truncated")));
  EXPECT_EQ(SafetensorsFile::Read(TempPath("nope.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open(TempPath("nope.safetensors"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(f.status().message(), HasSubstr("nope.safetensors"));
}

}  // namespace
}  // namespace preft::model

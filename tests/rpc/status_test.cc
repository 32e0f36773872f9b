#include "common/rpc/status.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace preft::rpc {
namespace {

// google.rpc.Code: OK = 0 ... UNAUTHENTICATED = 16, the same numbers in both libraries.
constexpr int kLastCode = 16;

TEST(RpcStatusTest, EveryAbslCodeRoundTripsWithItsMessage) {
  for (int c = 1; c <= kLastCode; ++c) {
    const absl::Status status(static_cast<absl::StatusCode>(c),
                              absl::StrCat("max_tokens = ", c, ": out of range \xe2\x9c\x93"));
    const grpc::Status g = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(g.error_code()), c) << status;
    EXPECT_EQ(g.error_message(), status.message());
    EXPECT_EQ(FromGrpcStatus(g), status);
  }
}

TEST(RpcStatusTest, EveryGrpcCodeRoundTripsWithItsMessage) {
  for (int c = 1; c <= kLastCode; ++c) {
    const grpc::Status g(static_cast<grpc::StatusCode>(c), absl::StrCat("code ", c));
    const absl::Status status = FromGrpcStatus(g);
    EXPECT_EQ(static_cast<int>(status.code()), c);
    EXPECT_EQ(status.message(), g.error_message());
    const grpc::Status back = ToGrpcStatus(status);
    EXPECT_EQ(back.error_code(), g.error_code());
    EXPECT_EQ(back.error_message(), g.error_message());
  }
}

TEST(RpcStatusTest, CodesMapByValue) {
  for (int c = 0; c <= kLastCode; ++c) {
    EXPECT_EQ(static_cast<int>(ToGrpcCode(static_cast<absl::StatusCode>(c))), c);
    EXPECT_EQ(static_cast<int>(FromGrpcCode(static_cast<grpc::StatusCode>(c))), c);
  }
}

TEST(RpcStatusTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(RpcStatusTest, EmptyMessageStaysEmpty) {
  const grpc::Status g = ToGrpcStatus(absl::Status(absl::StatusCode::kNotFound, ""));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(g.error_message(), "");
}

TEST(RpcStatusTest, CodesOutsideTheCanonicalSetBecomeUnknown) {
  EXPECT_EQ(FromGrpcCode(grpc::StatusCode::DO_NOT_USE), absl::StatusCode::kUnknown);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(99), "m")),
            absl::UnknownError("m"));
  const grpc::Status g = ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(42), "m"));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(g.error_message(), "m");
}

}  // namespace
}  // namespace preft::rpc

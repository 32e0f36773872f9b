// TLS and mutual TLS on a real loopback server, with certificates made by
// scripts/make-dev-certs.sh (openssl): who gets in, who is refused, and the errors for bad files.

#include "common/rpc/tls.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/rpc/server.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "tests/rpc/fake_preft_service.h"

namespace preft::rpc {
namespace {

namespace fs = std::filesystem;
using grpc::health::v1::Health;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(fs::temp_directory_path() / ("preft-tls-" + std::to_string(getpid())));
    const std::string cmd = std::string("bash ") + PREFT_SOURCE_DIR +
                            "/scripts/make-dev-certs.sh " + *dir_ + " > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static std::string File(const std::string& name) { return *dir_ + "/" + name; }

  static TlsFiles ServerFiles(bool mutual) {
    TlsFiles f;
    f.cert = File("server.pem");
    f.key = File("server.key");
    if (mutual) f.ca = File("ca.pem");
    return f;
  }

  // Starts a server with `files`; returns its address.
  std::string Serve(const TlsFiles& files) {
    auto credentials = MakeServerCredentials(files);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    ServerOptions o;
    o.services = {&preft_};
    o.credentials = *credentials;
    auto server = Server::Start(o);
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    return server_->address();
  }

  // A health check through `credentials`: OK, or the gRPC error.
  static grpc::Status Check(const std::string& address,
                            std::shared_ptr<grpc::ChannelCredentials> credentials) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse out;
    return Health::NewStub(grpc::CreateChannel(address, credentials))->Check(&ctx, req, &out);
  }
  static std::shared_ptr<grpc::ChannelCredentials> Client(const std::string& ca,
                                                          const std::string& cert = "",
                                                          const std::string& key = "") {
    TlsFiles f;
    f.ca = ca.empty() ? "" : File(ca);
    f.cert = cert.empty() ? "" : File(cert);
    f.key = key.empty() ? "" : File(key);
    auto c = MakeChannelCredentials(f);
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }

  static std::string* dir_;
  fakes::FakePreftService preft_;
  std::unique_ptr<Server> server_;
};

std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, TlsServesClientsThatTrustItsCa) {
  const std::string address = Serve(ServerFiles(/*mutual=*/false));
  EXPECT_TRUE(Check(address, Client("ca.pem")).ok());
  // A client that does not trust the CA, and a plaintext client, get nowhere.
  EXPECT_EQ(Check(address, Client("rogue-ca.pem")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Check(address, grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutACertificateOfItsCa) {
  const std::string address = Serve(ServerFiles(/*mutual=*/true));
  EXPECT_TRUE(Check(address, Client("ca.pem", "client.pem", "client.key")).ok());
  EXPECT_EQ(Check(address, Client("ca.pem")).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a client without a certificate got in";
  EXPECT_EQ(Check(address, Client("ca.pem", "rogue.pem", "rogue.key")).error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "a client certified by another CA got in";
  EXPECT_EQ(Check(address, grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ClientAuthNoneServesTlsClientsWithoutCertificates) {
  TlsFiles files = ServerFiles(/*mutual=*/true);
  files.require_client = false;
  const std::string address = Serve(files);
  EXPECT_TRUE(Check(address, Client("ca.pem")).ok());
}

TEST_F(TlsTest, BadFilesAreRefusedNamingTheFlagAndFile) {
  auto expect_error = [](const TlsFiles& f, const std::string& needle) {
    auto server = MakeServerCredentials(f);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(server.status().message().find(needle), std::string::npos) << server.status();
  };
  TlsFiles f = ServerFiles(true);
  f.key = "";
  expect_error(f, "--tls-cert and --tls-key go together");
  f = ServerFiles(true);
  f.cert = File("missing.pem");
  expect_error(f, "--tls-cert '" + File("missing.pem") + "': cannot be read");
  f = ServerFiles(true);
  f.key = File("server.pem");  // a certificate where the key should be
  expect_error(f, "not a PEM file with a PRIVATE KEY");
  std::ofstream(File("garbage.pem")) << "not pem at all";
  f = ServerFiles(true);
  f.ca = File("garbage.pem");
  expect_error(f, "--tls-ca");
  TlsFiles ca_only;
  ca_only.ca = File("ca.pem");
  expect_error(ca_only, "nothing to serve TLS with");
  TlsFiles client;
  client.ca = File("garbage.pem");
  EXPECT_EQ(MakeChannelCredentials(client).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace preft::rpc

#include "common/rpc/tls.h"

#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace preft::rpc {

namespace {

// The file's text, which must hold a PEM block of `kind` ("CERTIFICATE", "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path,
                                    const std::string& kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " '", path, "': cannot be read"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  const std::string pem = text.str();
  // "-----BEGIN CERTIFICATE-----", "-----BEGIN EC PRIVATE KEY-----", ...
  if (!absl::StrContains(pem, "-----BEGIN ") || !absl::StrContains(pem, kind + "-----")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " '", path, "': not a PEM file with a ", kind));
  }
  return pem;
}

absl::Status CheckPair(const TlsFiles& f) {
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  return absl::OkStatus();
}

}  // namespace

void AddTlsFlags(CLI::App& app, TlsFiles* f) {
  app.add_option("--tls-cert", f->cert, "PEM certificate: serve TLS, and present it when dialling")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", f->key, "PEM private key of --tls-cert")->check(CLI::ExistingFile);
  app.add_option("--tls-ca", f->ca, "PEM CA bundle: verify servers dialled and clients (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option_function<std::string>(
         "--tls-client-auth",
         [f](const std::string& v) { f->require_client = v == "require"; },
         "with --tls-ca: require (default) or none (TLS without client certificates)")
      ->check(CLI::IsMember({"require", "none"}));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& f) {
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  if (!f.serves_tls()) {
    if (!f.ca.empty()) {
      return absl::InvalidArgumentError("--tls-ca without --tls-cert/--tls-key: nothing to serve TLS with");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions o(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPem("--tls-cert", f.cert, "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("--tls-key", f.key, "PRIVATE KEY");
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  o.pem_key_cert_pairs.push_back(std::move(pair));
  if (!f.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls-ca", f.ca, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = f.require_client
                                       ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                       : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& f) {
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  if (f.ca.empty() && !f.serves_tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  if (!f.ca.empty()) {  // else the system's roots
    absl::StatusOr<std::string> ca = ReadPem("--tls-ca", f.ca, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
  }
  if (f.serves_tls()) {
    absl::StatusOr<std::string> cert = ReadPem("--tls-cert", f.cert, "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem("--tls-key", f.key, "PRIVATE KEY");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

}  // namespace preft::rpc

#include "services/router/registry_postgres.h"

#include <libpq-fe.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/base/status_macros.h"

namespace preft::router {

// A finished query's rows (text format); frees the result.
class PostgresRegistryStore::Rows {
 public:
  explicit Rows(PGresult* r) : r_(r, &PQclear) {}
  int size() const { return PQntuples(r_.get()); }
  std::string Text(int row, int col) const { return PQgetvalue(r_.get(), row, col); }
  int64_t Int(int row, int col) const {
    int64_t v = 0;
    return absl::SimpleAtoi(Text(row, col), &v) ? v : 0;
  }
  // Rows an INSERT or DELETE touched.
  int64_t Affected() const {
    int64_t v = 0;
    return absl::SimpleAtoi(PQcmdTuples(r_.get()), &v) ? v : 0;
  }

 private:
  std::unique_ptr<PGresult, void (*)(PGresult*)> r_;
};

namespace {

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS preft_adapter_versions (
  name text NOT NULL,
  version bigint NOT NULL,
  registered_path text NOT NULL,
  path text NOT NULL,
  kind text NOT NULL,
  default_positions text NOT NULL,
  rank bigint NOT NULL,
  bytes bigint NOT NULL,
  PRIMARY KEY (name, version));
CREATE TABLE IF NOT EXISTS preft_adapter_preload (name text PRIMARY KEY);
)sql";

constexpr char kColumns[] =
    "name, version, registered_path, path, kind, default_positions, rank, bytes";

// libpq's messages end in a newline.
std::string Reason(const char* message) {
  return std::string(absl::StripTrailingAsciiWhitespace(message ? message : ""));
}

RegistryRecord RecordAt(const PostgresRegistryStore::Rows& rows, int i) {
  RegistryRecord r;
  r.name = rows.Text(i, 0);
  r.version = rows.Int(i, 1);
  r.registered_path = rows.Text(i, 2);
  r.path = rows.Text(i, 3);
  r.kind = rows.Text(i, 4) == "direft" ? model::AdapterKind::kDireft : model::AdapterKind::kLora;
  model::ParseAdapterPositions(rows.Text(i, 5), &r.default_positions);
  r.rank = rows.Int(i, 6);
  r.bytes = rows.Int(i, 7);
  return r;
}

absl::Status NotRegistered(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("adapter '", name, "' is not registered"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostgresRegistryStore>> PostgresRegistryStore::Connect(
    const std::string& uri) {
  std::unique_ptr<PostgresRegistryStore> store(new PostgresRegistryStore(uri));
  {
    absl::MutexLock lock(&store->mu_);
    PREFT_RETURN_IF_ERROR(store->Reconnect());
  }
  // Two routers starting at once may both create the tables: one of them sees a duplicate.
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<Rows> made = store->Query(kSchema, {});
    if (made.ok()) break;
    if (attempt == 2) return made.status();
  }
  return store;
}

PostgresRegistryStore::~PostgresRegistryStore() {
  absl::MutexLock lock(&mu_);
  if (conn_ != nullptr) PQfinish(conn_);
}

absl::Status PostgresRegistryStore::Reconnect() const {
  if (conn_ != nullptr) PQfinish(conn_);
  conn_ = PQconnectdb(uri_.c_str());
  // "relation already exists, skipping" and the like are not the operator's business.
  PQsetNoticeProcessor(conn_, [](void*, const char*) {}, nullptr);
  if (PQstatus(conn_) != CONNECTION_OK) {
    const std::string why = Reason(PQerrorMessage(conn_));
    PQfinish(conn_);
    conn_ = nullptr;
    return absl::UnavailableError(absl::StrCat("adapter registry database: ", why));
  }
  return absl::OkStatus();
}

absl::StatusOr<PostgresRegistryStore::Rows> PostgresRegistryStore::Query(
    const char* sql, const std::vector<std::string>& params) const {
  std::vector<const char*> values;
  for (const std::string& p : params) values.push_back(p.c_str());
  absl::MutexLock lock(&mu_);
  for (int attempt = 0;; ++attempt) {
    if (conn_ == nullptr || PQstatus(conn_) != CONNECTION_OK) PREFT_RETURN_IF_ERROR(Reconnect());
    PGresult* r = params.empty()
                      ? PQexec(conn_, sql)
                      : PQexecParams(conn_, sql, static_cast<int>(params.size()), nullptr,
                                     values.data(), nullptr, nullptr, 0);
    Rows rows(r);
    const ExecStatusType st = PQresultStatus(r);
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return rows;
    const char* state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    if (state != nullptr && std::strcmp(state, "23505") == 0) {  // unique_violation
      return absl::AlreadyExistsError("the record exists");
    }
    // A connection that broke (the server restarted or shut down: SQLSTATE class 08, 57P,
    // or a client-side error with no state) gets one more try on a new one.
    const bool broken = PQstatus(conn_) != CONNECTION_OK || state == nullptr ||
                        std::strncmp(state, "08", 2) == 0 || std::strncmp(state, "57P", 3) == 0;
    const std::string why = Reason(PQresultErrorMessage(r));
    if (broken) {
      PQfinish(conn_);
      conn_ = nullptr;
      if (attempt == 0) continue;
      return absl::UnavailableError(absl::StrCat("adapter registry database: ", why));
    }
    return absl::InternalError(absl::StrCat("adapter registry database: ", why));
  }
}

absl::Status PostgresRegistryStore::Create(const RegistryRecord& r) const {
  const absl::StatusOr<Rows> done = Query(
      "INSERT INTO preft_adapter_versions "
      "(name, version, registered_path, path, kind, default_positions, rank, bytes) "
      "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
      {r.name, absl::StrCat(r.version), r.registered_path, r.path, model::AdapterKindName(r.kind),
       model::AdapterPositionsName(r.default_positions), absl::StrCat(r.rank),
       absl::StrCat(r.bytes)});
  if (absl::IsAlreadyExists(done.status())) {
    return absl::AlreadyExistsError(
        absl::StrCat("adapter '", r.name, "' version ", r.version, " exists"));
  }
  return done.status();
}

absl::StatusOr<int64_t> PostgresRegistryStore::CurrentVersion(const std::string& name) const {
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query("SELECT coalesce(max(version), 0) FROM preft_adapter_versions WHERE name = $1",
            {name}));
  return rows.size() == 1 ? rows.Int(0, 0) : 0;
}

absl::StatusOr<RegistryRecord> PostgresRegistryStore::Read(const std::string& name,
                                                           int64_t version) const {
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query(absl::StrCat("SELECT ", kColumns,
                         " FROM preft_adapter_versions WHERE name = $1 AND version = $2")
                .c_str(),
            {name, absl::StrCat(version)}));
  if (rows.size() == 0) {
    return absl::NotFoundError(
        absl::StrCat("adapter '", name, "' has no version ", version));
  }
  return RecordAt(rows, 0);
}

absl::StatusOr<std::vector<RegistryRecord>> PostgresRegistryStore::List() const {
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query(absl::StrCat("SELECT DISTINCT ON (name) ", kColumns,
                         " FROM preft_adapter_versions ORDER BY name, version DESC")
                .c_str(),
            {}));
  std::vector<RegistryRecord> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(RecordAt(rows, i));
  return out;
}

absl::Status PostgresRegistryStore::Remove(const std::string& name) const {
  // One statement: the records and the preload mark go together.
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query("WITH mark AS (DELETE FROM preft_adapter_preload WHERE name = $1) "
            "DELETE FROM preft_adapter_versions WHERE name = $1",
            {name}));
  return rows.Affected() > 0 ? absl::OkStatus() : NotRegistered(name);
}

absl::Status PostgresRegistryStore::SetPreload(const std::string& name, bool preload) const {
  if (!preload) {
    PREFT_ASSIGN_OR_RETURN(const Rows rows,
                           Query("WITH gone AS (DELETE FROM preft_adapter_preload WHERE name = $1) "
                                 "SELECT count(*) FROM preft_adapter_versions WHERE name = $1",
                                 {name}));
    return rows.size() == 1 && rows.Int(0, 0) > 0 ? absl::OkStatus() : NotRegistered(name);
  }
  // Marked only while registered (a racing removal leaves no stray mark).
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query("INSERT INTO preft_adapter_preload (name) SELECT $1 WHERE EXISTS "
            "(SELECT 1 FROM preft_adapter_versions WHERE name = $1) ON CONFLICT DO NOTHING",
            {name}));
  if (rows.Affected() > 0) return absl::OkStatus();
  PREFT_ASSIGN_OR_RETURN(const int64_t version, CurrentVersion(name));
  return version > 0 ? absl::OkStatus() : NotRegistered(name);  // already marked, or unknown
}

absl::StatusOr<std::vector<std::string>> PostgresRegistryStore::Preloaded() const {
  PREFT_ASSIGN_OR_RETURN(
      const Rows rows,
      Query("SELECT p.name FROM preft_adapter_preload p WHERE EXISTS "
            "(SELECT 1 FROM preft_adapter_versions v WHERE v.name = p.name) ORDER BY p.name",
            {}));
  std::vector<std::string> out;
  for (int i = 0; i < rows.size(); ++i) out.push_back(rows.Text(i, 0));
  return out;
}

}  // namespace preft::router

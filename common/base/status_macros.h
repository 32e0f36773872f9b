#pragma once

// Status propagation macros. Debian's Abseil 20220623 ships none of its own.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PREFT_CONCAT_INNER_(a, b) a##b
#define PREFT_CONCAT_(a, b) PREFT_CONCAT_INNER_(a, b)

// Returns from the current function if `expr` (an absl::Status) is not OK.
#define PREFT_RETURN_IF_ERROR(expr)                 \
  do {                                              \
    ::absl::Status preft_status_ = (expr);          \
    if (!preft_status_.ok()) return preft_status_;  \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define PREFT_ASSIGN_OR_RETURN(lhs, rexpr) \
  PREFT_ASSIGN_OR_RETURN_IMPL_(PREFT_CONCAT_(preft_statusor_, __LINE__), lhs, rexpr)

#define PREFT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

// The same for coroutines (rpc::Task), which end with co_return.
#define PREFT_CO_RETURN_IF_ERROR(expr)                 \
  do {                                                 \
    ::absl::Status preft_status_ = (expr);             \
    if (!preft_status_.ok()) co_return preft_status_;  \
  } while (0)

#define PREFT_CO_ASSIGN_OR_RETURN(lhs, rexpr) \
  PREFT_CO_ASSIGN_OR_RETURN_IMPL_(PREFT_CONCAT_(preft_statusor_, __LINE__), lhs, rexpr)

#define PREFT_CO_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)  \
  auto statusor = (rexpr);                                     \
  if (!statusor.ok()) co_return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

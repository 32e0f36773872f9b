#pragma once

// Which family of CPU kernels runs: the best this CPU allows (cpu_features.h), lowered by a
// cap that tests set. Layout choices made when weights load (low_rank_layout.h) follow it too,
// so it lives apart from the kernels (no OpenMP, no OpenBLAS).

namespace preft::kernels::cpu {

// Kernel families, weakest first. Linear picks the best one the CPU (cpu_features.h) and
// the test cap allow.
enum class LinearIsa : int { kScalar = 0, kAvx2, kAvx512, kAvx512Bf16, kAmx };

const char* LinearIsaName(LinearIsa isa);

// The level Linear uses now: the CPU's best, lowered by SetLinearIsaCapForTesting.
LinearIsa ActiveLinearIsa();

// Caps the level Linear uses (kAmx removes the cap). Tests only; not thread-safe with
// concurrent Linear calls.
void SetLinearIsaCapForTesting(LinearIsa cap);

}  // namespace preft::kernels::cpu

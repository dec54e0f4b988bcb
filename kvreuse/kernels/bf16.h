// bf16 <-> fp32 by bit operations, for loops GCC vectorizes: widening is exact; rounding is to nearest, ties to even,
// a NaN to torch's NaN, as c10's rounding (without its branch). Shared by pointwise.cpp and gguf_linear.cpp.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvreuse {

__attribute__((always_inline)) inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? 0x7fc0u : static_cast<uint16_t>(rounded);
}

__attribute__((always_inline)) inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

}  // namespace kvreuse

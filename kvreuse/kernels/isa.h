// The instruction sets kvreuse's CPU kernels are written for, as the ops take and return them (an `int` in the op
// schemas). kvreuse/kernels/build.py's `Isa` mirrors these values; tests/test_gguf_kernel.py reads this header to
// keep the two equal.
#pragma once

#include <cstdint>

namespace kvreuse {

enum class Isa : int64_t {
  kNone = 0,    // neither: the caller runs pure torch ops
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512F (with the above)
};

}  // namespace kvreuse

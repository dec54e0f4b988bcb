// The 8-bit KV formats' Hadamard rotation (hadamard.cpp), for the kernels that work in that basis.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvreuse {

// x [..., D] fp32 or bf16, contiguous -> [..., D]: each run of D & -D values times the normalized Hadamard matrix.
at::Tensor hadamard(const at::Tensor& x);

}  // namespace kvreuse

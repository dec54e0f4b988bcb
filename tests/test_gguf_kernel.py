"""The GGUF block kernel (kvreuse/kernels) on random blocks of every supported type: the blocks dequantize bit for
bit to what gguf-py gives, and each kernel variant's product equals the float64 product with those weights within
fp32 rounding, for odd output counts (a padded last tile), row counts that leave every remainder of the row tiling,
inputs that are not 64-byte aligned, and scales that fp16 cannot hold (the fp32 records)."""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from kvreuse.kernels import build as kernels
from kvreuse.weights.gguf_blocks import SUPPORTED, from_gguf

STATUS = kernels.load()
ISAS = [isa for isa in (1, 2) if isa <= STATUS.isa]
needs_kernel = pytest.mark.skipif(not ISAS, reason=f"no kernel here: {STATUS.reason}")
# Byte offsets of each type's fp16 fields within a block (d; Q4_1's m; Q4_K's dmin): set to finite halves.
HALF_FIELDS = {QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q8_0: (0,), QType.Q4_K: (0, 2),
               QType.Q6_K: (208,)}


def random_tensor(qtype: QType, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """A GGUF tensor [rows, bytes per row] of random blocks: random codes, random finite fp16 scales."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        halves = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_blocks_dequantize_to_gguf_py_bit_for_bit(qtype):
    data = random_tensor(qtype, 37, 512)
    blocks = from_gguf(data, qtype)
    assert blocks.shape == (37, 512)
    assert torch.equal(blocks.dequantize(), reference(data, qtype))
    # Rows picked out (the rotary un-permutation) keep their values.
    index = torch.tensor([5, 0, 36, 2])
    assert torch.equal(blocks.rows(index).dequantize(), reference(data, qtype)[index])


def test_unsupported_types_are_left_to_the_dense_path():
    assert from_gguf(np.zeros((4, 176), dtype=np.uint8), QType.Q5_K) is None
    assert from_gguf(np.zeros((4, 16), dtype=np.float32), QType.F32) is None


@needs_kernel
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: kernels.ISAS[i])
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 45, 64])  # to ROW_LIMITS[-1]
def test_kernel_equals_the_dequantized_product(qtype, isa, num_rows):
    # 37 outputs: the last 16-row panel is padded; 768 inputs: 24 blocks (3 Q4_K super-blocks).
    data = random_tensor(qtype, 37, 768, seed=num_rows)
    blocks = from_gguf(data, qtype)
    packed = blocks.pack()
    # 3 panels x 24 blocks of records: 16 scales, 16 mins (twice for Q6_K), 16 rows of codes. The 32-input formats'
    # scales and mins are fp16 numbers (their d is), the super-block formats' products of two scales are not.
    groups = 2 if qtype == QType.Q6_K else 1
    assert blocks.group == 32 // groups
    assert packed.half_scales == (qtype not in (QType.Q4_K, QType.Q6_K))
    scale_bytes = 2 if packed.half_scales else 4
    assert packed.data.numel() == 3 * 24 * 16 * (2 * scale_bytes * groups + blocks.bits * 32 // 8)
    weight = reference(data, qtype).double()                              # [37, 768]
    # A view one float into a buffer: contiguous, but not on a 64-byte (or 32-byte) boundary.
    buffer = torch.randn(num_rows * 768 + 1, generator=torch.Generator().manual_seed(num_rows))
    x = buffer[1:].view(num_rows, 768)
    assert x.data_ptr() % 32 != 0
    y = torch.ops.kvreuse_cpu.gguf_linear(x, packed.data, 37, packed.bits, packed.group, packed.half_scales, isa)
    expected = x.double() @ weight.T                                      # [T, 37]
    assert y.shape == (num_rows, 37) and y.dtype == torch.float32
    # fp32 accumulation over 768 terms: a few units in the last place of the largest output.
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_a_rows_product_has_the_same_bits_whatever_the_row_count_and_variant(qtype):
    """Batch invariance (docs/design/batch-invariance.md): each row sums in one order, so a prompt's rows computed
    after a cached prefix equal the same rows inside a cold run's whole-prompt product, and a decode row alone equals
    it beside others; the AVX2 and AVX-512 variants differ only in vector width, so they agree too."""
    data = random_tensor(qtype, 37, 768, seed=3)
    packed = from_gguf(data, qtype).pack()
    x = torch.randn(100, 768, generator=torch.Generator().manual_seed(3))

    def product(rows: torch.Tensor, isa: int) -> torch.Tensor:
        return torch.ops.kvreuse_cpu.gguf_linear(rows.contiguous(), packed.data, 37, packed.bits, packed.group,
                                                 packed.half_scales, isa)

    whole = product(x, ISAS[-1])                                          # [100, 37]
    for isa in ISAS:
        for start, count in [(99, 1), (0, 2), (40, 5), (3, 8), (90, 9), (50, 13), (20, 17), (7, 31), (36, 64)]:
            assert torch.equal(product(x[start:start + count], isa), whole[start:start + count]), (isa, count)
        assert torch.equal(product(x, isa), whole), isa


@needs_kernel
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: kernels.ISAS[i])
def test_mins_beyond_fp16_are_exact(isa):
    # Q8_0's min is -128 d: for d = 600 that is beyond fp16's range; the records hold it in fp32.
    data = random_tensor(QType.Q8_0, 8, 64)
    data[:, 0:2] = np.frombuffer(np.float16(600).tobytes(), dtype=np.uint8)
    blocks = from_gguf(data, QType.Q8_0)
    packed = blocks.pack()
    assert not packed.half_scales
    assert packed.data.view(-1, 16 * (2 * 4 + 32))[0, :32].view(torch.float32).tolist() == [600.0] * 8
    x = torch.randn(3, 64)
    y = torch.ops.kvreuse_cpu.gguf_linear(x, packed.data, 8, packed.bits, packed.group, False, isa)
    expected = x.double() @ reference(data, QType.Q8_0).double().T
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())


@needs_kernel
def test_bf16_rows_are_multiplied_in_fp32_and_rounded_once():
    """The op takes a bf16 model's rows as they are and returns bf16: the product of the widened rows, rounded once, as
    the casts around it would give. The compiled step then has no cast of its own to fuse away."""
    packed = from_gguf(random_tensor(QType.Q4_1, 40, 256), QType.Q4_1).pack()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for isa in ISAS:
        y = torch.ops.kvreuse_cpu.gguf_linear(x, packed.data, 40, packed.bits, packed.group, packed.half_scales, isa)
        fp32 = torch.ops.kvreuse_cpu.gguf_linear(x.float(), packed.data, 40, packed.bits, packed.group,
                                                 packed.half_scales, isa)
        assert y.dtype == torch.bfloat16 and torch.equal(y, fp32.to(torch.bfloat16))


@needs_kernel
def test_bad_calls_are_refused_with_the_reason():
    blocks = from_gguf(random_tensor(QType.Q4_1, 8, 64), QType.Q4_1).pack()
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.kvreuse_cpu.gguf_linear(torch.randn(1, 64).half(), blocks.data, 8, 4, 32, True, ISAS[0])
    with pytest.raises(RuntimeError, match="records"):
        torch.ops.kvreuse_cpu.gguf_linear(torch.randn(1, 64), blocks.data, 20, 4, 32, True, ISAS[0])
    with pytest.raises(RuntimeError, match="records"):  # records of fp32 scales are longer
        torch.ops.kvreuse_cpu.gguf_linear(torch.randn(1, 64), blocks.data, 8, 4, 32, False, ISAS[0])
    with pytest.raises(RuntimeError, match="bits and group"):
        torch.ops.kvreuse_cpu.gguf_linear(torch.randn(1, 64), blocks.data, 8, 4, 16, True, ISAS[0])
    with pytest.raises(RuntimeError, match="isa"):
        torch.ops.kvreuse_cpu.gguf_linear(torch.randn(1, 64), blocks.data, 8, 4, 32, True, 7)


def test_the_python_isa_enum_mirrors_the_kernels_header():
    header = kernels.HEADERS[0].read_text()
    values = {name.lower(): int(value) for name, value in re.findall(r"^\s*k(\w+) = (\d+),", header, re.MULTILINE)}
    assert values == {isa.name.lower(): isa.value for isa in kernels.Isa} == {"none": 0, "avx2": 1, "avx512": 2}


def test_the_build_is_kept_per_source_and_torch():
    directory = kernels.build_dir()
    assert directory.name.startswith("kvreuse_cpu-")
    if STATUS.isa:
        assert any(directory.glob("*.so")), "the built extension is not where the next process looks"
        # Built from the copies kept beside it, so another checkout of the same sources finds it up to date.
        ninja = (directory / "build.ninja").read_text()
        assert all(f"compile {directory / s.name}" in ninja for s in kernels.SOURCES), ninja
        # It names this environment's torch headers too, so another environment's torch builds in another directory
        # (sharing one, they rebuilt in turn).
        assert str(Path(torch.__file__).parent / "include") in ninja


def test_another_torch_installation_builds_in_its_own_directory(monkeypatch, tmp_path):
    here = kernels.build_dir()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "site-packages" / "torch" / "__init__.py"))
    assert kernels.build_dir() != here and kernels.build_dir().parent == here.parent


@pytest.mark.skipif(not STATUS.loaded, reason=f"no extension here: {STATUS.reason}")
def test_a_killed_builds_lock_file_does_not_hang_the_next_start():
    # torch's file baton, as a build killed mid-compile leaves it: without the builder lock every later load waits
    # on it forever.
    directory = kernels.build_dir()
    (directory / "lock").touch()
    done = subprocess.run([sys.executable, "-m", "kvreuse.kernels.build"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout and "left by a build that did not finish" in done.stderr
    assert not (directory / "lock").exists()


def test_the_builder_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kvreuse.kernels.build import builder_lock
        with builder_lock(Path({str(tmp_path)!r})):
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "builder.lock", "w") as handle:
            with pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait(timeout=10)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a killed holder's lock is gone with it
    finally:
        holder.kill()
        holder.wait(timeout=10)


@pytest.mark.skipif(not STATUS.loaded, reason=f"no extension here: {STATUS.reason}")
def test_both_ops_have_fake_functions_so_the_compiled_graph_can_call_them():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        product = torch.ops.kvreuse_cpu.gguf_linear(torch.empty(3, 64), torch.empty(100, dtype=torch.uint8), 8, 4,
                                                    32, True, 1)
        q = torch.empty(2, 4, 16)
        attended = torch.ops.kvreuse_cpu.decode_attention(q, q[:, :1], q[:, :1], torch.empty(8, 4, 1, 16),
                                                          torch.empty(8, 4, 1, 16), torch.empty(2, dtype=torch.long),
                                                          torch.empty(2, 8, dtype=torch.long),
                                                          torch.empty(2, dtype=torch.long), 0.25)
    assert tuple(product.shape) == (3, 8) and tuple(attended.shape) == (2, 64)

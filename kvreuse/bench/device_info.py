"""What a check ran on: the accelerator (name, memory, compute capability), the CPU model, and the software."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

from kvreuse.tuning import dtype_probe

PACKAGES = ("transformers", "tokenizers", "safetensors", "numpy", "triton", "pydantic")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def describe(device: str) -> dict:
    """The machine and software for `device` ("cpu" or "cuda"); RuntimeError for cuda without a CUDA device."""
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": dtype_probe.cpu_identity()["cpu"], "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            **{package: _version(package) for package in PACKAGES}}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                               f"(built for CUDA {torch.version.cuda})")
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
                 "gpus": torch.cuda.device_count()}
    return info

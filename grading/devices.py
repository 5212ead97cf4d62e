"""The device tests and notebooks make their tensors on: the GPU natively when there is one, else the CPU.

Triton kernels need their tensors on the device they run on: natively that is CUDA memory (a CPU tensor is
refused with "cpu tensor?"), in the interpreter (no GPU, `TRITON_INTERPRET=1`) it is CPU memory. Every test and
notebook cell that launches a kernel makes its tensors on `DEVICE`, so the same code runs both ways.
"""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

__all__ = ["DEVICE"]

"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before ``kernels.triton_attention`` is imported (``@triton.jit``
picks interpreter or compiler when the kernel is defined), so it is set here, in the top-level
conftest, before any test module imports ``kernels`` (directly or through ``services.worker``).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before ``kernels.triton_attention`` is imported (``@triton.jit``
picks interpreter or compiler when the kernel is defined), so it is set here, in the top-level
conftest, before any test module imports ``kernels`` (directly or through ``services.worker``).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each pytest worker draws its free ports (services.common.ports) from its own slice of the
# range, and so do the servers its tests start, so that two workers never pick the same port
# between one's pick and its bind (a serve binds its router seconds after picking its ports).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault(
        "PAGEDSERVE_PORT_SLICE",
        f"{int(os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw'))}"
        f"/{os.environ['PYTEST_XDIST_WORKER_COUNT']}")

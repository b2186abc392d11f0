"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before ``kernels.triton_attention`` is imported (``@triton.jit``
picks interpreter or compiler when the kernel is defined), so it is set here, in the top-level
conftest, before any test module imports ``kernels`` (directly or through ``services.worker``).
"""

import atexit
import os
import shutil
import tempfile

import torch

# Every JSON answer and streamed event of the router's HTTP API is checked against its declared
# model (services.router.openai.schema_check): a mismatch is an HTTP 500 / a broken stream, so
# every stack test also holds the code to /openapi.json.
os.environ["PAGEDSERVE_CHECK_RESPONSES"] = "1"

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

# The routers the tests start write their usage rows (services/router/usage) into a temporary
# SQLite file of this test process, never into the user's ~/.cache/pagedserve/usage.sqlite3
# (a test that checks the rows names its own --usage-db).
if "PAGEDSERVE_USAGE_DB" not in os.environ:
    _usage_dir = tempfile.mkdtemp(prefix="pagedserve-usage-")
    atexit.register(shutil.rmtree, _usage_dir, ignore_errors=True)
    os.environ["PAGEDSERVE_USAGE_DB"] = f"sqlite:///{_usage_dir}/usage.sqlite3"

#!/usr/bin/env bash
# Issue 5's GPU gate, as one prepared run on a CUDA machine (the H200 lent through `device`):
#   1. the kernel tests at full size (on CUDA tests/kernels adds the long cases, bf16, and every
#      GQA ratio x block size pairing);
#   2. the greedy-equivalence tests on CUDA: the model runner with the triton backend (float
#      weights, and 4-bit AWQ / GPTQ / GGUF layers on kernels/triton_int4.py), and the
#      whole gRPC stack (its worker picks cuda + triton by itself) against transformers;
#   3. the kernel benchmark sweep (batch 1..256 x context 128..32k), JSON into $OUT.
# The device machine has torch/triton/transformers/grpcio but no network: carry the missing
# wheels (gguf, grpcio-health-checking, grpcio-reflection, uvloop's pin, ...) in .whl as
# /work/.library/device/README.md describes, and the generated stubs (services/common/pb,
# clients/python/pagedserve_client/pb), then:
#   device run: bash scripts/gpu_check.sh   (carry: .whl services/common/pb clients/python/pagedserve_client/pb)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/clients/python:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
rc=0
timeout 240 python3 -m pytest -q -x tests/kernels 2>&1 | tee "$OUT/kernels.log" || rc=1
timeout 180 python3 -m pytest -q -x tests/worker/test_model.py tests/stack/test_equivalence.py \
  tests/worker/test_triton_int4_models.py 2>&1 | tee "$OUT/equivalence.log" || rc=1
timeout 240 python3 benchmarks/kernels/paged_attention.py --json "$OUT/paged_attention.json" \
  2>&1 | tee "$OUT/bench.log" || rc=1
exit $rc

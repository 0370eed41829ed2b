#!/usr/bin/env bash
# One-shot check on a machine with a CUDA GPU (run from the repository root; a few minutes):
#   1. the CUDA tests (agreement with transformers in float32 and bfloat16, graphs vs eager,
#      sampling on the device, an engine smoke test), which skip without a GPU;
#   2. the scope tests (request scope, property tests, runner failure) on the same machine;
#   3. `ft bench` on the default model at 1 / 16 / 64 concurrent requests (CUDA, bfloat16,
#      decode graphs), and with --enforce-eager for comparison; with 2+ GPUs, also on 2 ranks.
# The last lines are JSON: paste the tokens/s into docs/performance.md ("On a GPU").
# Needs a CUDA build of torch==2.13.0 (PyPI's default Linux wheel) and `pip install -e ".[test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: install a CUDA build of torch==2.13.0")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0)}", flush=True)
PY

echo "== CUDA tests (a tiny random model)"
python -m pytest -q -rs -s tests/model/test_device.py
# The rest needs the default model: pulled only now, so the tests above report even where it
# cannot be fetched.
python -m ft.cli pull >/dev/null
echo "== CUDA agreement with transformers (the default model)"
python -m pytest -q -rs -s "tests/model/test_agreement.py::test_cuda_matches_transformers"
echo "== scope tests"
python -m pytest -q tests/engine/test_request_scope.py tests/engine/test_scope_property.py \
  tests/engine/test_runner_failure.py

echo "== ft bench (CUDA, decode graphs)"
python -m ft.cli bench --device cuda --concurrency 1 16 64 --max-tokens 128
echo "== ft bench (CUDA, eager)"
python -m ft.cli bench --device cuda --enforce-eager --concurrency 1 16 64 --max-tokens 128
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "== ft bench (CUDA, 2 ranks over NCCL)"
  python -m ft.cli bench --device cuda --tensor-parallel-size 2 --concurrency 1 16 64 --max-tokens 128
fi

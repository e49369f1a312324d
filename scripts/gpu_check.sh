#!/usr/bin/env bash
# The checks that need a GPU, as one short run on a machine with a CUDA build of torch:
#   parity   greedy tokens and logits equal transformers' with both on the GPU (tests/test_model_parity.py)
#   e2e      `metrale serve` and LLM end to end (their tests take cuda when it is present)
#   faults   SIGKILL the worker under 32 live streams on the GPU (scripts/bench_faults.py)
#   compare  offline / serve / floor / transformers throughput on the GPU (scripts/bench_compare.py)
# Each step is time-boxed, so one hang costs one step; logs land in $OUT (default /tmp/gpu-check).
# Packages the machine lacks (pyzmq, msgspec) may come as wheels in .whl/.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi -L
python3 -c "import torch, metrale; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, show its tail
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}

step parity 100 env METRALE_TEST_DEVICE=cuda python3 -m pytest -q tests/test_model_parity.py
step e2e 150 python3 -m pytest -q -x tests/test_llm.py tests/test_serve_e2e.py tests/test_faults_e2e.py
step faults 90 python3 scripts/bench_faults.py --device cuda --kills 3
TAIL=30 step compare 220 python3 scripts/bench_compare.py --device cuda --preset bench-small --batch 32,128 --reps 2 \
  --engines offline,serve,floor,transformers

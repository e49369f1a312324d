#!/usr/bin/env bash
# The checks that need a GPU, as one short run, the most telling first. Each stage is time-boxed: 16 minutes if
# every one ran to its limit, a few when they pass; with little device time run STAGES="steps bench" first (6.5
# minutes at most) and the rest after. Stages:
#   steps    decode steps queue with no host sync; captured decode graphs == eager tokens (runner and LLM,
#            graphs on vs --enforce-eager); the Triton backend == the torch path (tests/test_cuda_steps.py), and
#            the Triton kernels compiled against the torch path, bf16 included (tests/test_triton_attention.py)
#   bench    bench_compare.py --device cuda on bench-small at batch 1, 32 and 128: offline, serve, the
#            forward-only floor and transformers (its JSON line is copied into the summary)
#   parity   greedy tokens and logits equal transformers' with both on the GPU (tests/test_model_parity.py)
#   e2e      LLM and `metrale serve` end to end, and the worker SIGKILLed under live streams (their tests take
#            cuda when it is present)
#   gguf     the Triton GGUF kernels compiled against dequantize + matmul for every kept type, every launch
#            kind and the split over K (tests/test_triton_gguf.py), then scripts/bench_gguf_cuda.py: Q4_K, Q6_K,
#            Q8_0 layers against the dense bf16 matmul at 1, 8, 32 and 512 rows, TABLE's launch and the
#            alternatives beside it (its JSON line in $OUT/gguf_bench.json, the ratios and each best path copied
#            into the summary); 3 minutes at most, alone: STAGES=gguf
# Assumes the machine has a CUDA build of torch (which ships triton) and metrale's other dependencies and
# transformers, or their wheels in .whl/ (installed with --no-deps into /tmp/site); nothing else is installed
# beyond `pip install -e .` (no build isolation, no index). Logs and results land in $OUT (default
# /tmp/gpu-check); the last line printed, also $OUT/summary.json, is one JSON object of every stage's rc and
# seconds and the bench figures, written even when a stage fails or times out; the exit status is 1 if any failed.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-check}
STAGES=${STAGES:-"steps bench parity e2e gguf"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
: >"$OUT/stages.tsv"

summary() {  # the one JSON line: each stage's rc and seconds, and bench_compare's JSON line when there is one
  python3 - "$OUT" <<'EOF' | tee "$OUT/summary.json"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
stages = {}
for line in (out / "stages.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    stages[name] = {"rc": int(rc), "s": int(secs)}
bench, figures = None, {}
log = out / "bench.json"
if log.exists():
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")]
    bench = json.loads(lines[-1]) if lines else None
for key, r in ((bench or {}).get("results") or {}).items():  # issue 21's targets, per batch
    tps = {name: f.get("throughput_tok_s") for name, f in r.items() if name != "ratios"}
    ratio = lambda a, b: round(tps[a] / tps[b], 3) if tps.get(a) and tps.get(b) else None
    figures[key] = {
        "tok_s": tps,
        "offline_vs_floor": ratio("offline", "floor"),  # target >= 0.9
        "offline_vs_transformers": ratio("offline", "transformers"),  # target >= 1.0
        "floor_decode_step_ms": (r.get("floor") or {}).get("decode_step_ms_median"),  # target <= 1.5 at b32
        "serve_worker_idle_decode": (r.get("serve") or {}).get("worker_idle_decode"),  # target < 0.02
    }
gguf = None
log = out / "gguf_bench.json"
if log.exists():
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")]
    g = json.loads(lines[-1]) if lines else {}
    gguf = {k: g.get(k) for k in ("device", "table", "worst_ratio", "slower_than_dense", "wrong")} if g else None
    if gguf:  # triton ms / dense bf16 ms per layer, type and rows (target <= 1.0), and the best path's ratio
        gguf["ratios"] = {k: [r["ratio"], r["best_ratio"], r["best"]] for k, r in g["results"].items()}
print(json.dumps({"gpu_check": stages, "figures": figures, "bench": bench, "gguf": gguf}))
EOF
}
trap summary EXIT

stage() {  # stage NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, show its tail
  local name=$1 limit=$2 rc=0
  shift 2
  case " setup $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/stages.tsv"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s" >&2
  tail -n "${TAIL:-12}" "$OUT/$name.log" >&2
}

if [ -d .whl ]; then
  export PYTHONPATH=/tmp/site
fi
stage setup 90 bash -c '
  set -euo pipefail
  if [ -d .whl ]; then
    "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  "$0" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  nvidia-smi -L
  "$0" -c "import importlib.util, torch, metrale; print(\"torch\", torch.__version__, torch.cuda.get_device_name(), \"triton\", importlib.util.find_spec(\"triton\") is not None)"
' "$PY"
if [ "$(cut -f2 "$OUT/stages.tsv" | head -n1)" != "0" ]; then
  exit 1  # nothing else can run; the summary still says why
fi

stage steps 150 env METRALE_TEST_DEVICE=cuda "$PY" -m pytest -q tests/test_cuda_steps.py tests/test_triton_attention.py
TAIL=30 stage bench 240 sh -c "'$PY' scripts/bench_compare.py --device cuda --preset bench-small --batch 1,32,128 \
  --max-num-seqs 128 --reps 1 --engines offline,serve,floor,transformers >'$OUT/bench.json'"
stage parity 150 env METRALE_TEST_DEVICE=cuda "$PY" -m pytest -q tests/test_model_parity.py
stage e2e 150 "$PY" -m pytest -q -x tests/test_llm.py tests/test_serve_e2e.py tests/test_faults_e2e.py
# gguf: the kernel compiles dominate, so the tests run as four shards beside the bench's compiles (--warm, one
# process per type, into triton's cache), then the bench alone.
TAIL=45 stage gguf 180 bash -c '
  py=$0 out=$1 rc=0 pids=() i=0
  for t in Q4_K Q6_K Q8_0; do
    timeout -k 5 110 "$py" scripts/bench_gguf_cuda.py --warm --types $t >"$out/gguf_warm_$t.log" 2>&1 &
    pids+=($!)
  done
  typed="Q8_0 or Q5_0 or IQ4_NL or Q4_0 or Q4_1 or Q4_K or Q5_1 or Q5_K or Q6_K"
  for sel in "Q8_0 or Q5_0 or IQ4_NL or Q4_0" "Q4_1 or Q4_K or Q5_1" "Q5_K or Q6_K" "not ($typed)"; do
    i=$((i + 1))
    METRALE_TEST_DEVICE=cuda timeout -k 5 110 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_gguf.py \
      -k "$sel" >"$out/gguf_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for log in "$out"/gguf_warm_*.log "$out"/gguf_tests_*.log; do
    echo "-- $log"; grep -E "FAILED|ERROR|Error|passed|failed|skipped|bench_gguf_cuda|\"warm\"" "$log" | tail -n 6
  done
  timeout -k 5 55 "$py" scripts/bench_gguf_cuda.py >"$out/gguf_bench.json" || rc=1
  exit "$rc"
' "$PY" "$OUT"
if cut -f2 "$OUT/stages.tsv" | grep -qv '^0$'; then
  exit 1
fi

#!/bin/bash
# On the GPU machine, from the project's root, after `bash benchmarks/gpu/wheels.sh` on this one (the
# device tool's run with carry [".whl"]: it sends only the checkout):
#   bash benchmarks/gpu/run.sh [SECONDS] [MODE ...]        # default: 120 sandbox off packed
# MODE: sandbox ([run] gpus = 1, sandboxed), off (gpus = 1, sandbox = "off"), packed (gpus = $PACK,
# default 0.25: four stages share the GPU, sandboxed), packed-off. Each mode runs the loop on a fresh
# copy of lab/ (3 tasks, a small transformer per run) for 2 offline hypotheses, at most SECONDS,
# sampling nvidia-smi every 0.5 s; report.py then prints, per mode and side by side: GPU busy % and
# mean utilisation from the first stage's start to the last one's end, runs per GPU-hour, and each
# stage's dispatch overhead (its wall less the compute train.py reports). Device time is about 15
# minutes a session, start-up included: three modes of 120 s and the install take about 7.
set -u
SECS=${1:-120}; shift $(( $# > 0 ? 1 : 0 )); MODES=${*:-sandbox off packed}; PACK=${PACK:-0.25}
R=$PWD; OUT=${OUT:-/tmp/gpu-bench}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
T0=$(date +%s); step() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
step facts
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V; nproc
step install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
git config --global user.email r@lab; git config --global user.name r
ALL=()
for MODE in $MODES; do
  step "lab ($MODE, $SECS s)"
  L=/tmp/gpulab-$MODE; rm -rf "$L"; cp -r "$R/benchmarks/gpu/lab" "$L"
  case $MODE in *off*) sed -i 's/^retries = 1$/retries = 1\nsandbox = "off"/' "$L/research.toml";; esac
  case $MODE in packed*) sed -i "s/^gpus = 1$/gpus = $PACK/" "$L/research.toml";; esac
  grep -E '^(gpus|sandbox) =' "$L/research.toml" | tr '\n' ' '; echo
  (cd "$L" && printf 'runs/\n' > .gitignore && git init -q -b main && git add -A && git commit -qm lab \
    && git branch autoresearch/baseline)
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader -lms 500 \
    > "$OUT/smi-$MODE.csv" & SMI=$!
  s=$(date +%s)
  (cd "$L" && timeout -k 20 -s INT "$SECS" autoresearch run --offline --max-hypotheses 2 > "$OUT/run-$MODE.txt" 2>&1)
  echo "run rc=$? wall=$(( $(date +%s) - s ))s"
  kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
  tail -6 "$OUT/run-$MODE.txt"
  (cd "$L" && autoresearch status 2>&1 | sed -n '1,4p;/compute/,$p' | head -20)
  python3 "$R/benchmarks/gpu/report.py" --mode "$MODE" "$L" "$OUT/smi-$MODE.csv"
  ALL+=(--mode "$MODE" "$L" "$OUT/smi-$MODE.csv")
done
step "side by side"
python3 "$R/benchmarks/gpu/report.py" "${ALL[@]}" --side-by-side
step done

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
#
# REHEARSE=1 (a machine without a GPU, e.g. before spending device time): no install (the project's
# .venv), a fake GPU 0 (CUDA_VISIBLE_DEVICES=0) and `fake-nvidia-smi` (utilisation [N/A]); the lab
# trains on CPU (require_cuda off, 1 epoch, d_model 32, cpus = 1). Only the sandbox-off modes (default
# `off packed-off`): the sandbox binds /dev/nvidia* that are not there. report.py's "GPU held" line
# (from the store) then says how much of the wall time the loop kept a stage on the GPU.
set -u
SECS=${1:-120}; shift $(( $# > 0 ? 1 : 0 )); PACK=${PACK:-0.25}; REHEARSE=${REHEARSE:-}
if [ -n "$REHEARSE" ]; then MODES=${*:-off packed-off}; else MODES=${*:-sandbox off packed}; fi
R=$PWD; OUT=${OUT:-/tmp/gpu-bench}; LABS=${LABS:-/tmp}; mkdir -p "$OUT" "$LABS"; export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
T0=$(date +%s); step() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
if [ -n "$REHEARSE" ]; then
  for MODE in $MODES; do
    case $MODE in *off) ;; *) echo "REHEARSE: mode $MODE needs /dev/nvidia*; use off or packed-off"; exit 2;; esac
  done
  BIN=$(mktemp -d); ln -s "$R/benchmarks/gpu/fake-nvidia-smi" "$BIN/nvidia-smi"; trap 'rm -rf "$BIN"' EXIT
  [ -x "$R/.venv/bin/autoresearch" ] && PATH="$R/.venv/bin:$PATH"
  export PATH="$BIN:$PATH" CUDA_VISIBLE_DEVICES=0 GIT_AUTHOR_NAME=r GIT_AUTHOR_EMAIL=r@lab \
    GIT_COMMITTER_NAME=r GIT_COMMITTER_EMAIL=r@lab
fi
step facts
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V; nproc
if [ -z "$REHEARSE" ]; then
  step install
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  git config --global user.email r@lab; git config --global user.name r
fi
ALL=()
for MODE in $MODES; do
  step "lab ($MODE, $SECS s)"
  L=$LABS/gpulab-$MODE; rm -rf "$L"; cp -r "$R/benchmarks/gpu/lab" "$L"
  case $MODE in *off*) sed -i 's/^retries = 1$/retries = 1\nsandbox = "off"/' "$L/research.toml";; esac
  case $MODE in packed*) sed -i "s/^gpus = 1$/gpus = $PACK/" "$L/research.toml";; esac
  if [ -n "$REHEARSE" ]; then  # CPU-sized: a run of a few seconds, a core per stage
    sed -i 's/^require_cuda = true$/require_cuda = false/; s/^epochs = 3$/epochs = 1/; s/^d_model = 128$/d_model = 32/' "$L/config.toml"
    sed -i 's/^cpus = 2$/cpus = 1/; s/^"train.epochs" = \[8\]$/"train.epochs" = [2]/' "$L/research.toml"
    for want in "require_cuda = false" "epochs = 1" "d_model = 32"; do  # the lab changed: say so, not train for minutes
      grep -qx "$want" "$L/config.toml" || { echo "REHEARSE: config.toml has no '$want' after the edit"; exit 2; }
    done
    grep -qx "cpus = 1" "$L/research.toml" || { echo "REHEARSE: research.toml has no 'cpus = 1' after the edit"; exit 2; }
  fi
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

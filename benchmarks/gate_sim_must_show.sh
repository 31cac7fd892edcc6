#!/bin/bash
# Issue 34's gate-sim must-show cells (nulls ≤ 0.027): pair ρ 0 / 0.5 / 0.95, this hypothesis pairing 0 while
# the history pairs 0.9, a challenger twice as noisy. One line per cell; about 1.5 min a cell on 2 cores.
cd "$(dirname "$0")/.."  # the repository root
for cell in "0.02 0 0 1 10 0" "0.6 0 0 1 10 0" "0.02 0.5 0.5 1 10 0" "0.02 0.95 0.95 1 10 0" "0.02 0 0.9 1 10 5" "0.6 0 0.9 1 10 0" "0.6 0 0 2 10 0" "0.6 0 0 2 10 5"; do
  set -- $cell
  out=$(nice -n 5 .venv/bin/autoresearch gate-sim --effect 0 --rho $1 --pair-rho $2 --history-pair-rho $3 --challenger-sd $4 --pair-history $5 --history $6 --trials 20000 --seed 7 --json 2>/dev/null)
  echo "$out" | python3 -c "
import json,sys,math
d=json.load(sys.stdin); p=d['improvement_rate']
n=d['trials']; print(f'effect 0 rho $1 pair_rho $2 hist_pair_rho $3 csd $4 pair_hist $5 hist $6 : {p:.4f} ± {math.sqrt(p*(1-p)/n):.4f}  runs {d[\"mean_challenger_runs\"]:.2f}')"
done

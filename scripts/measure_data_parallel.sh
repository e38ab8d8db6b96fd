#!/bin/bash
# Step time and peak memory of data-parallel training on this machine (docs/src/data-parallelism.md, "Several GPUs or
# machines"): 1 peer, 2 peers in one process (--devices 2), 2 nodes on 127.0.0.1 (--nodes 2 with
# `memsave orchestrator`), interleaved, twice each; the README job for one epoch. Needs
# `cargo build --release` first. Usage: scripts/measure_data_parallel.sh [OUT_DIR]
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$ROOT/target/release/memsave
C=$ROOT/configs/resnet18_synthetic.toml
OUT=${1:-$ROOT/work_dirs/measure_data_parallel}
S="--set runner.max_epochs=1 --set log_config.interval=4"
rm -rf "$OUT" && mkdir -p "$OUT" && cd "$OUT"
for round in 1 2; do
  $B train $C --work-dir w1-$round $S > one-$round.log 2>&1
  $B train $C --work-dir w2-$round --devices 2 $S > two-$round.log 2>&1
  P=$((4100 + round * 10))
  $B orchestrator --port $P > orch-$round.log 2>&1 &
  O=$!
  sleep 0.5
  $B train $C --work-dir wn0-$round --nodes 2 --node-rank 0 --orchestrator ws://127.0.0.1:$P --data-port $((P + 1)) $S > node0-$round.log 2>&1 &
  N0=$!
  $B train $C --work-dir wn1-$round --nodes 2 --node-rank 1 --orchestrator ws://127.0.0.1:$P --data-port $((P + 2)) $S > node1-$round.log 2>&1
  wait $N0
  kill $O
done
python3 - <<'PY'
import re
for name, what in [("one", "1 peer"), ("two", "2 peers, one process"), ("node0", "2 nodes (node 0)")]:
    for r in [1, 2]:
        lines = [l for l in open(f"{name}-{r}.log") if l.startswith("Epoch")]
        t = [float(re.search(r"time: ([\d.]+) s", l).group(1)) for l in lines]
        it = [int(re.search(r"\]\[(\d+)/", l).group(1)) for l in lines]
        m = [float(re.search(r"memory: ([\d.]+) MiB", l).group(1)) for l in lines]
        step = (t[-1] - t[0]) / (it[-1] - it[0])
        print(f"{what}, round {r}: {it[-1]} iterations an epoch, {step:.3f} s per step, peak {max(m):.1f} MiB")
PY

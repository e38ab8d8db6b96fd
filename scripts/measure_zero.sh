#!/bin/bash
# Per-peer memory, step time and traffic of ZeRO stages 0, 1 and 2 (docs/src/data-parallelism.md, "Optimizer state and
# gradients sharded across the peers"): ResNet-50 at 224 x 224, batch 2 per peer, Adam, 2 peers,
# as 2 processes on 127.0.0.1 (--nodes 2: each process's heap is one peer's) and as 2 threads of one
# process (--devices 2: the heap is both peers'); 4 iterations each, the stages interleaved.
# Needs `cargo build --release` first. Usage: scripts/measure_zero.sh [OUT_DIR] [ROUNDS]
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$ROOT/target/release/memsave
OUT=${1:-$ROOT/work_dirs/measure_zero}
ROUNDS=${2:-1}
rm -rf "$OUT" && mkdir -p "$OUT" && cd "$OUT"
cat > r50_adam.toml <<'TOML'
seed = 0
[model]
type = "ImageClassifier"
num_classes = 4
[model.backbone]
type = "ResNet"
depth = 50
with_cp = false
[data]
type = "SyntheticClassification"
samples_per_gpu = 2
num_samples = 16
image_size = 224
[optimizer]
type = "Adam"
lr = 1e-4
[optimizer_config]
grad_clip = { max_norm = 35.0, norm_type = 2.0 }
[runner]
type = "EpochBasedRunner"
max_epochs = 1
[log_config]
interval = 1
TOML
C=r50_adam.toml
for round in $(seq 1 "$ROUNDS"); do
  for stage in 0 1 2; do
    S="--set optimizer_config.zero_stage=$stage"
    $B train $C --work-dir wt$stage-$round --devices 2 $S > threads$stage-$round.log 2>&1
    P=$((4300 + round * 10 + stage * 3))
    $B orchestrator --port $P > orch$stage-$round.log 2>&1 &
    O=$!
    sleep 0.5
    $B train $C --work-dir wn0$stage-$round --nodes 2 --node-rank 0 --orchestrator ws://127.0.0.1:$P --data-port $((P + 1)) $S > node0s$stage-$round.log 2>&1 &
    N0=$!
    $B train $C --work-dir wn1$stage-$round --nodes 2 --node-rank 1 --orchestrator ws://127.0.0.1:$P --data-port $((P + 2)) $S > node1s$stage-$round.log 2>&1
    wait $N0
    kill $O
  done
done
ROUNDS=$ROUNDS python3 - <<'PY'
import os, re
rounds = int(os.environ["ROUNDS"])
def read(path):
    lines = [l for l in open(path) if l.startswith("Epoch [")]
    t = [float(re.search(r"time: ([\d.]+) s", l).group(1)) for l in lines]
    m = [float(re.search(r"memory: ([\d.]+) MiB", l).group(1)) for l in lines]
    return (t[-1] - t[0]) / (len(t) - 1), max(m)
print("| stage | run | s per step | peak |")
print("|---|---|---|---|")
for stage in [0, 1, 2]:
    # Rank 0 logs: node 0's figures are one peer's.
    for what, name in [("2 peers in one process (both)", "threads"), ("2 nodes: node 0", "node0s")]:
        figures = [read(f"{name}{stage}-{r}.log") for r in range(1, rounds + 1)]
        steps = ", ".join(f"{s:.2f}" for s, _ in figures)
        peaks = ", ".join(f"{p:.1f} MiB" for _, p in figures)
        print(f"| {stage} | {what} | {steps} | {peaks} |")
PY

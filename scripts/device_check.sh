#!/usr/bin/env bash
# The device check: memsave's device suite and benchmark on an NVIDIA GPU, in one run.
#
#   scripts/device_check.sh [OUT_DIR]        (default: work_dirs/device_check)
#
# 1. builds memsave with `--features cuda` (release) and the device suite (no CUDA toolkit is
#    needed: the driver is loaded at run time);
# 2. checks for an NVIDIA driver and GPU (stops with a clear message where none is found);
# 3. runs the device suite on CUDA (tests/device.rs: with_cp gradients, memsave's ops vs
#    Burn's, f16/bf16 with dynamic loss scaling, the pool meter, helper-thread recomputation,
#    `memsave train` and `memsave bench` on the device);
# 4. runs `memsave bench --device cuda --image-size 1000x600` (the strategy table and, on a
#    device, CPU staging's rows: offload_activations, offload_optimizer, all_offload, with the
#    host's peak) and, where PyTorch with CUDA is installed, `scripts/torch_reference.py --device
#    cuda` beside it (fp16 with a GradScaler; save_on_cpu and a host-stepped SGD for the offload
#    rows), so that the copies' time cost is measured in one run;
#    Then (unless PLAN=0) the planner at the article's scale: `memsave plan
#    configs/retinanet_r50_fpn_synthvoc_1000x600.toml --device cuda --budget 400MiB --iters 1`
#    on synthetic VOC images (R50-FPN, 2 images of 1000 x 600: the issue's 400 MiB target with
#    CPU staging; lavapipe cannot profile it in useful time), at most 4 minutes, not fatal;
# 5. writes OUT_DIR/device_check.md (one Markdown table to paste into docs/src/devices.md) and
#    OUT_DIR/device_check.json, and the logs of every step.
#
# Budget: about 12 minutes on a recent card (the build is most of it; set CARGO_TARGET_DIR to a
# warm target directory to skip it). Each step prints its progress and its time.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-work_dirs/device_check}"
mkdir -p "$OUT"
START=$(date +%s)
step() { printf '\n== [%4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
fail() { echo "device_check: $*" >&2; exit 1; }

step "1/5 build (cargo build --release --features cuda; the device suite)"
cargo build --release --features cuda --bin memsave 2>&1 | tail -n 3
cargo test --release --features cuda --test device --no-run 2>&1 | tail -n 3
MEMSAVE="${CARGO_TARGET_DIR:-target}/release/memsave"

step "2/5 NVIDIA driver and device"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  fail "no NVIDIA driver found (nvidia-smi is not on PATH): this check needs a machine with an NVIDIA GPU and its driver; memsave was built, nothing was run"
fi
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>"$OUT/gpu.err"; then
  fail "nvidia-smi found no usable GPU: $(cat "$OUT/gpu.err")"
fi
GPU=$(head -n1 "$OUT/gpu.txt")
echo "GPU: $GPU"

step "3/5 device suite on CUDA (cargo test --features cuda --test device)"
set +e
timeout 420 cargo test --release --features cuda --test device -- --nocapture --test-threads 1 \
  > "$OUT/suite.log" 2>&1
SUITE=$?
set -e
grep -E "^test |device suite:" "$OUT/suite.log" || true
grep -E "^test result" "$OUT/suite.log" || echo "(no result line: see $OUT/suite.log)"

step "4/5 memsave bench --device cuda --image-size 1000x600, beside PyTorch"
set +e
TORCH=skipped
COMPARE=()
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # The strategy table's configurations and CPU staging's (save_on_cpu, a host-stepped SGD).
  timeout 300 python3 scripts/torch_reference.py --device cuda --image-size 1000x600 --iters 3 \
    --only base,amp,accumulation,checkpoint,all,step_in_backward,lean,offload_activations,offload_optimizer,all_offload \
    --out "$OUT/torch.json" > "$OUT/torch.log" 2>&1 && TORCH=ran || TORCH=failed
  [ "$TORCH" = ran ] && COMPARE=(--compare "$OUT/torch.json")
else
  echo "PyTorch with CUDA is not installed: the PyTorch column is left out"
fi
timeout 300 "$MEMSAVE" bench --device cuda --image-size 1000x600 --iters 3 --out "$OUT/bench" \
  "${COMPARE[@]}" > "$OUT/bench.log" 2>&1
BENCH=$?
set -e
tail -n 30 "$OUT/bench.log"

PLANNED=skipped
if [ "${PLAN:-1}" != 0 ]; then
  step "4b/5 memsave plan at the article's scale (R50-FPN, 2 x 1000 x 600, 400 MiB)"
  set +e
  rm -rf "$OUT/plan_data"
  if "$MEMSAVE" data synth-voc "$OUT/plan_data" --images 12 > "$OUT/plan.log" 2>&1; then
    # TOML literal strings: the paths are taken as written.
    timeout 240 "$MEMSAVE" plan configs/retinanet_r50_fpn_synthvoc_1000x600.toml \
      --device cuda --budget 400MiB --iters 1 \
      --set "data.train.ann_file='$OUT/plan_data/VOC2007/ImageSets/Main/trainval.txt'" \
      --set "data.train.img_prefix='$OUT/plan_data/VOC2007/'" \
      --set "data.test.ann_file='$OUT/plan_data/VOC2007/ImageSets/Main/test.txt'" \
      --set "data.test.img_prefix='$OUT/plan_data/VOC2007/'" >> "$OUT/plan.log" 2>&1
    PLANNED="exit $?"
  else
    PLANNED="synth-voc failed"
  fi
  set -e
  tail -n 25 "$OUT/plan.log"
fi

step "5/5 report"
python3 - "$OUT" "$GPU" "$SUITE" "$BENCH" "$TORCH" "$PLANNED" <<'PY'
import json, re, sys, pathlib
out, gpu, suite, bench, torch, planned = sys.argv[1:]
out = pathlib.Path(out)
lines = [l for l in (out / "suite.log").read_text(errors="replace").splitlines() if "device suite:" in l]
tests = re.findall(r"^test (\S+) \.\.\. (\w+)", (out / "suite.log").read_text(errors="replace"), re.M)
report = {"gpu": gpu, "suite_exit": int(suite), "tests": dict(tests), "figures": lines,
          "bench_exit": int(bench), "torch_reference": torch, "plan": planned}
bench_json = out / "bench" / "bench.json"
if bench_json.exists():
    report["bench"] = json.loads(bench_json.read_text())
torch_json = out / "torch.json"
if torch_json.exists():
    report["torch"] = json.loads(torch_json.read_text())
(out / "device_check.json").write_text(json.dumps(report, indent=2))
md = [f"Device check on {gpu} (`scripts/device_check.sh`)", "",
      "| test | result |", "|---|---|"]
md += [f"| {name} | {result} |" for name, result in tests]
md += ["", "Figures (device suite):", ""] + [f"- {l.split('device suite:', 1)[1].strip()}" for l in lines]
table = [l for l in (out / "bench.log").read_text(errors="replace").splitlines() if l.startswith("|")]
md += ["", f"Benchmark (`memsave bench --device cuda --image-size 1000x600 --iters 3`, exit {bench}):", ""]
md += table or ["(no table: see bench.log)"]
md += ["", f"PyTorch reference: {torch}"]
plan_log = out / "plan.log"
md += ["", f"Planner at the article's scale (R50-FPN, 2 x 1000 x 600, budget 400 MiB): {planned}", ""]
if plan_log.exists():
    md += ["```"] + plan_log.read_text(errors="replace").splitlines()[-25:] + ["```"]
(out / "device_check.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
echo
echo "wrote $OUT/device_check.md and $OUT/device_check.json in $(( $(date +%s) - START )) s"
[ "$SUITE" -eq 0 ] && [ "$BENCH" -eq 0 ] || fail "a step failed: suite exit $SUITE, bench exit $BENCH (logs in $OUT)"

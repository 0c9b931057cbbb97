#!/usr/bin/env bash
# Pretrains a latent-space ShapesBench base end to end: the autoencoder (shape + colour channels),
# then the generator on its latents, sized to a wall-clock budget, then the probe. Runs unchanged on
# a CPU or a GPU (benchmarks/RESULTS.md):
#
#   benchmarks/shapes_base.sh OUT [BUDGET_S=480] [AE_STEPS=8000] [WORKERS=12] [BATCH=256]
#
# The generator's step count is whatever fits BUDGET_S at the rate measured by a 300-step
# calibration run (which also proves the whole path works before the long run starts).
# Writes OUT/{ae,calibrate,gen}.log, OUT/ae/{params,summary.json}, OUT/gen/{params,summary.json,metrics.jsonl,samples_final.png},
# OUT/probe.json and OUT/probe.png. GEN_EXTRA_FLAGS (env) adds overrides to the long run.
set -euo pipefail
out=${1:?usage: benchmarks/shapes_base.sh OUT [BUDGET_S] [AE_STEPS] [WORKERS] [BATCH]}
budget=${2:-480}
ae_steps=${3:-8000}
workers=${4:-12}
batch=${5:-256}
py=${PYTHON:-python}
mkdir -p "$out"
t0=$(date +%s)

# Logs go to files, not through a pipe: the first GPU run, with this step piped into grep, printed
# nothing and was killed at its 525 s limit (the same step writing to a file took 62 s; which
# process held the pipe open was not established).
$py -m digen_jax.tasks.shapes.pretrain_ae --workdir="$out/ae" --steps="$ae_steps" --batch=64 \
  --workers="$workers" --alsologtostderr >"$out/ae.log" 2>&1
tail -n 1 "$out/ae.log"

gen_flags=(--config=configs/shapes_pretrain.py:ae --config.latent.ae="$out/ae/params"
  --config.pretrain.batch="$batch" --config.pretrain.data_workers="$workers")
$py -m digen_jax.tasks.shapes.pretrain "${gen_flags[@]}" --workdir="$out/calibrate" \
  --config.pretrain.steps=300 --config.pretrain.log_every=100 --config.pretrain.eval_every=0 \
  --config.pretrain.save_every=0 --config.pretrain.final_eval_prompts=4 \
  --config.pretrain.final_eval_samples=1 >"$out/calibrate.log" 2>&1
rate=$($py -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; \
print(max(r['samples_per_s'] for r in rows if 'samples_per_s' in r))" "$out/calibrate/metrics.jsonl")
left=$((budget - ($(date +%s) - t0)))
# 85% of what is left trains; the rest pays for compiles, the evals and the final eval.
steps=$($py -c "print(max(500, int(0.85 * $left * $rate / $batch) // 500 * 500))")
echo "shapes_base: ${rate} samples/s -> ${steps} generator steps of ${batch} in the ${left}s left"

$py -m digen_jax.tasks.shapes.pretrain "${gen_flags[@]}" --workdir="$out/gen" --config.pretrain.steps="$steps" \
  --config.pretrain.log_every=500 --config.pretrain.eval_every=$((steps / 4)) \
  --config.pretrain.save_every=$((steps / 4)) ${GEN_EXTRA_FLAGS:-} >"$out/gen.log" 2>&1
tail -n 1 "$out/gen.log"
$py benchmarks/shapes_probe.py --params "$out/gen/params" --png "$out/probe.png" \
  --json "$out/probe.json"
echo "shapes_base: done in $(($(date +%s) - t0))s"

#!/usr/bin/env bash
# The GPU checks and benchmarks of megatron_lossfix in one go, each step's log under OUTDIR.
#
#   PYTHONPATH=$PWD examples/gpu_suite.sh OUTDIR STEP...
#
# Steps (run from the repository root, on a machine with CUDA and megatron-core importable):
#   env          GPU, driver and package versions
#   tests        tests/test_gpu.py: the gradient oracle on CUDA (fp32, bf16), NCCL, MoE alltoall,
#                multi-GPU layouts where there are several GPUs
#   logprobs     examples/benchmark_logprobs.py at vocab 32k/128k/152k, bf16 and fp32
#   megatron-lm  Megatron-LM's patched pretrain_gpt.py on one GPU, micro-batch 1 vs 4
#                (MEGATRON_LM_PATH: a core_v0.16.1 checkout with the patch applied)
#   first-step   the default first-step check against a plain step (examples/benchmark.py,
#                token_mean-first-step), one GPU: 404 M parameters (fp32) at micro-batch 2 and 1,
#                activations dominating at micro-batch 1, MoE at micro-batch 1
#                (FIRST_STEP_ARGS: extra flags for every run, e.g. a smaller model)
#   step-cost    examples/step_cost.py: a step's time by part, host syncs, collectives, kernels
#                (STEP_COST_ARGS: extra flags)
#   overhead     examples/benchmark.py against stock Megatron, fp32 and bf16, one GPU
#                (OVERHEAD_ARGS: extra flags for both runs, e.g. fewer rounds)
#
# The GPU checks of the first-step check and the per-step cost, as one prepared run:
#   PYTHONPATH=$PWD examples/gpu_suite.sh OUT env tests first-step step-cost overhead
set -uo pipefail
out=${1:?usage: $0 OUTDIR STEP...}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
status=0

step_env() {
  nvidia-smi
  "$py" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "cuda",
torch.version.cuda, torch.cuda.get_device_name(0), "x", torch.cuda.device_count(),
"megatron-core", m.__version__)'
  "$py" -c 'import transformer_engine' 2>&1 | tail -1
  command -v git patch make || true
}

step_tests() {
  "$py" -m pytest -v -s -p no:cacheprovider tests/test_gpu.py
}

step_logprobs() {
  for dtype in bfloat16 float32; do
    "$py" examples/benchmark_logprobs.py --device cuda --dtype $dtype --tokens 8192 --iters 10
  done
  # The CPU-sized default chunk (16 MiB of fp32: 128 rows at 32k, 27 at 152k), for comparison.
  "$py" examples/benchmark_logprobs.py --device cuda --dtype bfloat16 --tokens 8192 \
    --iters 10 --vocabs 32768 --chunk-size 128
  "$py" examples/benchmark_logprobs.py --device cuda --dtype bfloat16 --tokens 8192 \
    --iters 10 --vocabs 151936 --chunk-size 27
}

step_megatron_lm() {
  # The Megatron-LM runner is a test helper (tests/helpers/megatron_lm_run.py).
  PYTHONPATH="tests${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'EOF'
import os, tempfile
from helpers.megatron_lm_run import (
    run_pretrain_gpt, tiny_gpt_args, write_padded_dataset)

path, tmp = os.environ["MEGATRON_LM_PATH"], tempfile.mkdtemp()
data = write_padded_dataset(f"{tmp}/data/padded")
runs = {}
for reduction in ("token_mean", "off"):
    for mbs in (1, 4):
        flags = ["--loss-reduction", reduction]
        if reduction == "token_mean" and mbs == 4:
            flags.append("--lossfix-self-check")  # re-splits step 1 and raises on a mismatch
        args = tiny_gpt_args(micro_batch_size=mbs, train_iters=2, data_path=data)
        res = run_pretrain_gpt(path, [*args, *flags], metrics_out=f"{tmp}/{reduction}{mbs}.jsonl")
        assert res.returncode == 0, res.output[-4000:]
        runs[reduction, mbs] = res.metrics
        for rec in res.metrics:
            print(reduction, f"micro-batch {mbs}", {k: rec[k] for k in
                  ("iteration", "loss", "lm_loss", "grad_norm", "num_tokens")}, flush=True)
for reduction in ("token_mean", "off"):
    for a, b in zip(runs[reduction, 1], runs[reduction, 4]):
        rel = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
        print(f"{reduction}: iteration {a['iteration']}: grad norm rel diff mbs1 vs mbs4 {rel:.2e}")
        assert (rel <= 1e-5) == (reduction == "token_mean"), rel
EOF
}

step_first_step() {
  # 8 layers, hidden 2048, seq 1024: 404 M parameters, gradients dominating memory; then
  # activations dominating (seq 4096), dense and MoE. Time, tensor peak and fresh-process
  # peak of the checked step against a plain token_mean step.
  local common="--ranks 1 --workloads sft --variants token_mean-first-step --rounds 3
    --steps-per-round 1 --warmup 1 --memory-steps 1 --global-batch-size 8"
  local big="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024"
  local act="--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 4096"
  local name flags
  while read -r name flags; do
    echo "--- first step: $name"
    # shellcheck disable=SC2086 # flag lists split into words
    "$py" examples/benchmark.py $common $flags --json-out "$out/first_step_$name.json" \
      ${FIRST_STEP_ARGS:-} || return 1
  done <<RUNS
big-mbs2 $big --micro-batch-size 2
big-mbs1 $big --micro-batch-size 1
act-mbs1 $act --micro-batch-size 1
moe-mbs1 $act --micro-batch-size 1 --num-experts 8
RUNS
}

step_step_cost() {
  # bf16, the overhead table's model: where the plugin's milliseconds per step go.
  # shellcheck disable=SC2086
  "$py" -m torch.distributed.run --standalone --nproc-per-node 1 examples/step_cost.py --bf16 \
    --num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --global-batch-size 8 --micro-batch-size 1 --variants token_mean,sequence_mean \
    --workloads sft,rl --steps-per-round 10 ${STEP_COST_ARGS:-}
}

step_overhead() {
  # Steps of 250-320 ms (fp32, no TF32) and 150-180 ms (bf16) on an H100.
  "$py" examples/benchmark.py --ranks 1 --num-layers 8 --hidden-size 1024 \
    --num-attention-heads 16 --seq-length 1024 --global-batch-size 8 --micro-batch-size 1 \
    --rounds 5 --steps-per-round 2 --json-out "$out/overhead_fp32.json" ${OVERHEAD_ARGS:-}
  "$py" examples/benchmark.py --ranks 1 --bf16 --num-layers 4 --hidden-size 2048 \
    --num-attention-heads 16 --seq-length 2048 --global-batch-size 8 --micro-batch-size 1 \
    --rounds 4 --steps-per-round 2 --no-memory --json-out "$out/overhead_bf16.json" \
    --variants stock,stock-repeat,stock-per-token,off,token_mean,sequence_mean,sum,token_mean-per-token \
    ${OVERHEAD_ARGS:-}
}

for step in "$@"; do
  echo "=== $step ($(date +%T))"
  start=$SECONDS
  "step_${step//-/_}" 2>&1 | tee "$out/$step.log"
  rc=${PIPESTATUS[0]}
  echo "=== $step: exit $rc, $((SECONDS - start)) s"
  [ "$rc" = 0 ] || status=1
done
exit $status

#!/usr/bin/env bash
# The checks for one lent GPU (a single device, minutes of time), in one call, then one table.
#
#   bash tools/bench/gpu_session.sh                    # smoke bench quickstart (under 9 minutes on an H200)
#   bash tools/bench/gpu_session.sh bench long         # the training benchmark, then the long-context one
#
# smoke       tools/gpu_smoke.py on one GPU: logits vs HF, train step, offload/onload, the local
#             attention's varlen kernel vs blockwise (CP=1 and CP=2 emulated), NCCL.
# bench       tools/bench/train.py, local spec, bf16: Qwen2.5 0.5b / 1.5b / 3b shapes at 4k and 16k
#             tokens per micro-batch (varlen attention; 0.5b also blockwise at 4k), a kernel profile
#             of the 1.5b steps.
# long        tools/bench/long_context.py (one 16k / 32k sequence, CP=1).
# quickstart  the DAPO quickstart end to end on one GPU (SFT, evals, 10 RL steps; NCCL, fp32).
# Logs and JSON go to $OUT (default ./gpu_out); the last thing printed is tools/bench/gpu_report.py's table.
# Wheels in .whl/ (megatron-core and megarl's pure-Python needs missing from the machine's image)
# are installed to /tmp/site first.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if [ -d .whl ] && ! $PY -c "import megatron.core" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
'transformers', transformers.__version__, 'megatron-core', m.__version__)" | tee "$OUT/versions.txt"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L | tee "$OUT/device.txt"; fi
[ $# -gt 0 ] || set -- smoke bench quickstart

bench() {  # bench SHAPE SECONDS ARGS...: one bench_train run, its rows in $OUT/bench_SHAPE*.json
    local shape=$1 limit=$2 tag=$1
    shift 2
    case "$*" in *blockwise*) tag=$shape-blockwise ;; esac
    timeout "$limit" $PY -m tools.bench.train --shape "$shape" --impl local --steps 2 --json "$OUT/bench_$tag.json" "$@" \
        2>&1 | grep -v -i warn | tee "$OUT/bench_$tag.log"
    return "${PIPESTATUS[0]}"
}

rc=0
for what in "$@"; do
    start=$SECONDS
    case $what in
    smoke)
        timeout 130 $PY -m tools.gpu_smoke --skip sglang,fp8,logits_te,train_te,cp2 --json "$OUT/smoke.json" --verbose \
            2>&1 | tee "$OUT/smoke.log"
        status=${PIPESTATUS[0]}
        ;;
    bench)
        status=0
        bench 1.5b 110 --seq 4096,16384 --microbatches 4 --profile 25 || status=1
        bench 0.5b 60 --seq 4096,16384 --microbatches 4 || status=1
        bench 3b 90 --seq 4096,16384 --microbatches 2 || status=1
        bench 0.5b 45 --seq 4096 --microbatches 4 --attn blockwise || status=1
        ;;
    long)
        timeout 60 $PY -m tools.bench.long_context --lengths 16384 32768 --cp 1 2>&1 | grep -v -i warn \
            | tee "$OUT/long_context.log"
        status=${PIPESTATUS[0]}
        ;;
    quickstart)
        rm -rf /tmp/qs_gpu
        timeout 140 $PY -m megarl.cli quickstart --nproc 1 parallel.tp=1 trainer.total_steps=10 \
            trainer.eval_interval=10 trainer.save_interval=10 trainer.run_dir=/tmp/qs_gpu 2>&1 | tee "$OUT/quickstart.log"
        status=${PIPESTATUS[0]}
        cp /tmp/qs_gpu/metrics.jsonl "$OUT/quickstart_metrics.jsonl" 2>/dev/null
        ;;
    *) echo "unknown check: $what"; exit 2 ;;
    esac
    echo "== $what: exit $status in $((SECONDS - start)) s"
    [ "$status" = 0 ] || rc=1
done
$PY -m tools.bench.gpu_report "$OUT" | tee "$OUT/report.md"
exit $rc

#!/usr/bin/env bash
# The checks for one lent GPU (a single device, minutes of time), in order of importance.
#
#   bash tools/gpu_session.sh smoke quickstart        # what a first call runs
#   bash tools/gpu_session.sh bench                    # speed and memory of the local spec
#
# smoke       tools/gpu_smoke.py on one GPU (logits vs HF, train step, offload/onload, NCCL).
# quickstart  the DAPO quickstart end to end on one GPU (SFT, evals, 10 RL steps; NCCL, fp32).
# bench       tools/bench_train.py (0.5b shape, local spec, 2 micro-batches of 4k/16k tokens) and
#             tools/bench_long_context.py (one sequence of 16k/32k tokens, CP=1).
# Timings of all three on one H100 (2026-11-26): README, "What is verified where".
# Logs and JSON go to $OUT (default ./gpu_out). Wheels in .whl/ (megatron-core and megarl's
# pure-Python needs missing from the machine's image) are installed to /tmp/site first.
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
'transformers', transformers.__version__, 'megatron-core', m.__version__)"
command -v nvidia-smi >/dev/null && nvidia-smi -L

rc=0
for what in "$@"; do
    start=$SECONDS
    case $what in
    smoke)
        timeout 240 $PY tools/gpu_smoke.py --json "$OUT/smoke.json" --verbose 2>&1 | tee "$OUT/smoke.log"
        ;;
    quickstart)
        rm -rf /tmp/qs_gpu
        timeout 300 $PY -m megarl.cli quickstart --nproc 1 parallel.tp=1 trainer.total_steps=10 \
            trainer.eval_interval=10 trainer.save_interval=10 trainer.run_dir=/tmp/qs_gpu 2>&1 | tee "$OUT/quickstart.log"
        cp /tmp/qs_gpu/metrics.jsonl "$OUT/quickstart_metrics.jsonl" 2>/dev/null
        ;;
    bench)
        timeout 150 $PY tools/bench_train.py --shape 0.5b --seq 4096,16384 --steps 2 --microbatches 2 --impl local \
            --json "$OUT/bench_train.json" 2>&1 | grep -v -i warn | tee "$OUT/bench_train.log"
        timeout 90 $PY tools/bench_long_context.py --lengths 16384 32768 --cp 1 2>&1 | grep -v -i warn \
            | tee "$OUT/long_context.log"
        ;;
    *) echo "unknown check: $what"; exit 2 ;;
    esac
    status=${PIPESTATUS[0]}
    echo "== $what: exit $status in $((SECONDS - start)) s"
    [ "$status" = 0 ] || rc=1
done
exit $rc

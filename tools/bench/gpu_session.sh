#!/usr/bin/env bash
# The checks for one lent GPU (one H100 / H200) in one call, then one table: tools/bench/gpu_session.py.
#
#   bash tools/bench/gpu_session.sh --wheels .whl                    # every step that fits --budget
#   bash tools/bench/gpu_session.sh --wheels .whl --budget 270 rl_sglang sglang_smoke weight_sync
#
# --wheels DIR  wheels to install first (python -m tools.bench.gpu_wheels assembles DIR here: TE 2.11,
#               megatron-core 0.16.1, SGLang 0.5.17, torch-memory-saver, megarl's math reward; carry it),
#               with pip --no-index --no-deps --target /tmp/site, plus DIR/stubs/IPython where IPython is missing
# --budget S    seconds from now (the install included) after which no step starts; default 420
# steps         step or phase names (python -m tools.bench.gpu_session --help); none: all, in priority order
# $OUT (default ./gpu_out) gets report.md, session.json and logs.tgz; the table is printed last.
set -u
t0=$(date +%s)
WHEELS=.whl
BUDGET=420
args=()
while [ $# -gt 0 ]; do
    case $1 in
    --wheels) WHEELS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done
OUT=${OUT:-gpu_out}
WORK=/tmp/gpu_session
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
# the SGLang bundle has no flashinfer; its JIT kernels (nvcc, triton) are cached for every step
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 SGLANG_IS_FLASHINFER_AVAILABLE=false \
    TVM_FFI_CACHE_DIR=/tmp/sgl-cache/tvm-ffi TRITON_CACHE_DIR=/tmp/sgl-cache/triton
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl >"$WORK/pip.log" 2>&1; then
        tail -n 20 "$WORK/pip.log"; exit 1
    fi
    if ! $PY -c "import IPython" 2>/dev/null && [ -d "$WHEELS/stubs/IPython" ]; then
        cp -r "$WHEELS/stubs/IPython" /tmp/site/   # sglang/utils.py imports IPython.display only
    fi
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
$PY - <<'EOF' 2>&1 | tee "$WORK/versions.txt"
import importlib.metadata as m
names = ["torch", "transformers", "megatron-core", "transformer-engine", "transformer-engine-torch", "sglang",
         "sglang-kernel", "torch-memory-saver", "triton"]
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "-"
import torch
print(", ".join(f"{n} {version(n)}" for n in names) + f"; CUDA {torch.version.cuda}")
EOF
if command -v nvidia-smi >/dev/null; then nvidia-smi -L | tee "$WORK/device.txt"; fi
exec $PY -m tools.bench.gpu_session --out "$OUT" --work "$WORK" --deadline $((t0 + BUDGET)) --wheels "$WHEELS" \
    ${args[@]+"${args[@]}"}

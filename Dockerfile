# megarl GPU image: NGC PyTorch base + SGLang + Transformer Engine + megatron-core + nemo-run.
#
# Build (needs a CUDA-capable build host or at least nvcc in the base image; TE compiles its
# PyTorch extension):
#   docker build -t megarl:gpu .
#   enroot import -o megarl.sqsh dockerd://megarl:gpu     # for Slurm + pyxis: --container megarl.sqsh
#
# Version resolution (verified only by reading package metadata; not built on this project's CI):
# - sglang 0.5.23 pins torch==2.14.1, transformers==5.19.0, tokenizers==0.23.2 and CUDA-13 kernels
#   (flashinfer cu13, sglang-kernel). Its kernels are compiled against that exact torch, so the
#   image takes SGLang's torch and drops the container's own torch build.
# - Replacing torch breaks every extension the base image compiled against its torch (Transformer
#   Engine, apex, flash-attn): they are uninstalled, and Transformer Engine is rebuilt from source
#   against torch 2.14.1 (the base image supplies nvcc and cuDNN). apex is not rebuilt:
#   megatron-core takes fused Adam / norms from TE first and only falls back to apex.
# - megatron-core 0.16.1's [dev] extra wants transformer-engine >=2.9.0a0,<2.12.0 -> 2.11.0.
# - megarl itself pins torch==2.13.0 and transformers==4.57.1 for the CPU development environment;
#   here it is installed with --no-deps and its remaining dependencies are installed from
#   pyproject.toml minus torch / transformers / tokenizers / megatron-core, which the SGLang and
#   TE stack provide (so the GPU image runs megarl on transformers 5.19.0).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
ARG TORCH_VERSION=2.14.1
ARG TE_VERSION=2.11.0
ARG MCORE_VERSION=0.16.1
ARG NEMO_RUN_VERSION=0.11.1
ARG LEPTONAI_VERSION=0.26.7

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# 1. drop the base image's torch and everything compiled against it
RUN pip uninstall -y torch torchvision torchaudio transformer_engine transformer-engine \
        transformer_engine_torch transformer_engine_cu12 transformer_engine_cu13 apex flash_attn \
        torch_tensorrt megatron-core

# 2. SGLang with the torch it was built for
RUN pip install --no-cache-dir "sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}" \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# 3. Transformer Engine built against that torch, then megatron-core and the launcher stack
RUN NVTE_FRAMEWORK=pytorch MAX_JOBS=8 pip install --no-cache-dir --no-build-isolation \
        "transformer_engine[pytorch,core_cu13]==${TE_VERSION}" \
    && pip install --no-cache-dir "megatron-core==${MCORE_VERSION}" \
        "nemo-run==${NEMO_RUN_VERSION}" "leptonai==${LEPTONAI_VERSION}" "torch==${TORCH_VERSION}"

# 4. megarl: code without its CPU pins, then its other dependencies from pyproject.toml
WORKDIR /opt/megarl
COPY pyproject.toml ./
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
skip = {'torch', 'transformers', 'tokenizers', 'megatron-core', 'nemo-run', 'leptonai'}; \
print('\n'.join(d for d in deps if re.split(r'[<>=!~\[; ]', d, maxsplit=1)[0].lower() not in skip))" \
        > /tmp/megarl-deps.txt \
    && printf 'torch==%s\n' "${TORCH_VERSION}" > /tmp/constraints.txt \
    && pip install --no-cache-dir -r /tmp/megarl-deps.txt -c /tmp/constraints.txt
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import megarl, megatron.core, sglang, transformer_engine.pytorch, nemo_run; print('megarl image ok')"

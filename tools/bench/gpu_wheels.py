"""The wheel folder a GPU session installs first (tools/bench/gpu_session.sh --wheels DIR), assembled here.

    python -m tools.bench.gpu_wheels --shared ../shared/gpu --out .whl --download   # then carry .whl

The device machine has torch 2.11 + CUDA 13 and Python 3.12 but no Transformer Engine, megatron-core,
SGLang or megarl's pure-Python needs, and nothing can be fetched there; what it installs travels
with the working tree, 64 MiB in all. The folder holds, one version of each distribution:

- `<shared>/wheels/*.whl`: TE 2.11 (core library pruned to sm_90), megatron-core 0.16.1 and TE's
  missing requirements (../shared/gpu/README.md);
- `<shared>/sglang/wheels/*.whl`: the minimal SGLang 0.5.17 set, and its two-file IPython stub
  as `stubs/IPython` (installed only where IPython is missing);
- PyPI wheels downloaded here (`--download`, pip's ordinary client): torch-memory-saver, which
  SGLang imports for `enable_memory_saver` (release / resume of its memory: the colocated loop),
  and megarl's math reward (math-verify, latex2sympy2_extended, antlr4-python3-runtime).

The same distribution found twice is kept once when the versions agree; two versions stop the
assembly (pip --no-deps would install both and leave either). MANIFEST.txt lists the wheels; the
total and what remains of the 64 MiB next to the working tree are printed, and a folder that
does not fit fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CARRY_LIMIT = 64 << 20  # bytes that travel with a device call: working tree + carried paths
PYPI = {  # name -> version, wheels pip downloads here for the device machine (Python 3.12, x86-64)
    "torch-memory-saver": "0.0.10",
    "math-verify": "0.9.0",
    "latex2sympy2_extended": "1.11.0",
    "antlr4-python3-runtime": "4.13.2",
}
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalised distribution name
    version: str

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def normalise(name: str) -> str:
    """PEP 503 name, with '_' (as wheel file names write it): 'Foo.Bar-baz' -> 'foo_bar_baz'."""
    return re.sub(r"[-_.]+", "_", name).lower()


def parse_wheel(path: Path) -> Wheel:
    """name and version from a wheel file name (PEP 427: name-version(-build)?-python-abi-platform.whl)."""
    parts = path.name[: -len(".whl")].split("-") if path.name.endswith(".whl") else []
    if len(parts) not in (5, 6):
        raise ValueError(f"{path}: not a wheel file name (name-version-python-abi-platform.whl)")
    return Wheel(path, normalise(parts[0]), parts[1])


def collect(folders: list[Path]) -> list[Wheel]:
    """One wheel per distribution from `folders` (in order); ValueError on two versions of one."""
    chosen: dict[str, Wheel] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.whl")):
            w = parse_wheel(path)
            have = chosen.get(w.name)
            if have is not None and have.version != w.version:
                raise ValueError(f"two versions of {w.name}: {have.path.name} and {w.path.name}; keep one")
            chosen.setdefault(w.name, w)
    return sorted(chosen.values(), key=lambda w: w.name)


def download(cache: Path, pins: dict[str, str]) -> None:
    """pip download of the pinned wheels missing from `cache` (no dependencies: each is pinned here)."""
    cache.mkdir(parents=True, exist_ok=True)
    have = {parse_wheel(p).name for p in cache.glob("*.whl")}
    todo = [f"{n}=={v}" for n, v in pins.items() if normalise(n) not in have]
    if not todo:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(cache)] + [a for p in PLATFORMS for a in ("--platform", p)] + todo
    subprocess.run(cmd, check=True)


def tree_bytes(repo: Path) -> int:
    """Bytes of the files a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, check=True,
                         capture_output=True).stdout.decode()
    return sum((repo / f).stat().st_size for f in out.split("\0") if f and (repo / f).is_file())


def assemble(shared: Path, out: Path, extra: list[Path], stubs: Path | None = None) -> list[Wheel]:
    """Fills `out` (emptied first) with the wheels of `shared`/wheels, `shared`/sglang/wheels and the
    `extra` folders, one per distribution, the IPython stub, and MANIFEST.txt."""
    wheels = collect([shared / "wheels", shared / "sglang" / "wheels", *extra])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w.path, out / w.path.name)
    stubs = stubs if stubs is not None else shared / "sglang" / "stubs"
    if (stubs / "IPython").is_dir():
        shutil.copytree(stubs / "IPython", out / "stubs" / "IPython")
    (out / "MANIFEST.txt").write_text("".join(f"{w.path.name}\t{w.size}\n" for w in wheels))
    return wheels


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=str(Path(__file__).resolve().parents[3] / "shared" / "gpu"))
    p.add_argument("--out", default=".whl")
    p.add_argument("--download", action="store_true", help=f"pip download {sorted(PYPI)} into --cache first")
    p.add_argument("--cache", default="/tmp/megarl-gpu-wheels", help="where the PyPI wheels are kept")
    p.add_argument("--repo", default=".", help="the checkout that travels (for the 64 MiB total)")
    args = p.parse_args(argv)
    cache = Path(args.cache)
    if args.download:
        download(cache, PYPI)
    wheels = assemble(Path(args.shared), Path(args.out), [cache] if cache.is_dir() else [])
    size, tree = folder_bytes(Path(args.out)), tree_bytes(Path(args.repo))
    for w in wheels:
        print(f"{w.size / 2**20:8.2f} MiB  {w.path.name}")
    missing = [n for n in PYPI if normalise(n) not in {w.name for w in wheels}]
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}; working tree {tree / 2**20:.1f} MiB; "
          f"together {(size + tree) / 2**20:.1f} of {CARRY_LIMIT >> 20} MiB"
          + (f"; not included (run with --download): {missing}" if missing else ""))
    return 0 if size + tree <= CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())

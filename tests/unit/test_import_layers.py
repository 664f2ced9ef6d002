"""megarl's packages form layers and imports point down (docs/design.md, "Layers").

Every `import megarl...` / `from megarl... import` / relative import in every module of megarl/,
at the top of a file or inside a function, is checked: a module may import its own package and
the packages of lower layers, never a package of its own layer or above. A second check finds
circles among megarl's files (a file that imports, through any chain, itself). Only third-party
imports may be deferred into functions for weight (Transformer Engine, SGLang, apex, nemo_run):
they are outside megarl and not checked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megarl"

# bottom to top; a package may import only from the layers below its own (and from itself)
LAYERS: list[tuple[str, ...]] = [
    ("megarl.registry", "megarl.log"),
    ("megarl.algorithms", "megarl.parallel"),
    ("megarl.config",),
    ("megarl.models",),
    ("megarl.weights",),
    ("megarl.rollout",),
    ("megarl.data", "megarl.rewards"),
    ("megarl.tool_runtime",),
    ("megarl.trainer",),
    ("megarl.planner", "megarl.convert", "megarl.evaluate", "megarl.report"),
    ("megarl.tasks",),
    ("megarl.quickstart",),
    ("megarl.cli",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, megarl module) of every megarl import in the file, wherever it stands; `from X
    import y` counts X and, when y is a module of X, X.y too."""
    me = module_name(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "megarl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megarl":
                continue
            if target != "megarl":  # `from megarl import x` imports x, not the (empty) package root
                out.append((node.lineno, target))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if module_path(sub) is not None:
                    out.append((node.lineno, sub))
    return out


def module_path(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, package) of a megarl module; None for the package root itself."""
    for i, layer in enumerate(LAYERS):
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    return None


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in all_modules() if module_name(p) != "megarl" and layer_of(module_name(p)) is None]
    assert not unplaced, f"modules in no layer (add their package to LAYERS and docs/design.md): {unplaced}"


def test_imports_point_down():
    bad = []
    for path in all_modules():
        src = layer_of(module_name(path))
        if src is None:
            continue
        for line, target in imported_modules(path):
            dst = layer_of(target)
            if dst is None:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target}, which is in no layer")
            elif dst[1] != src[1] and dst[0] >= src[0]:
                bad.append(f"{path.relative_to(REPO)}:{line} ({src[1]}, layer {src[0]}) imports {target} "
                           f"({dst[1]}, layer {dst[0]})")
    assert not bad, "imports that do not point down:\n" + "\n".join(sorted(set(bad)))


def test_no_circles_among_files():
    graph = {module_name(p): {t for _, t in imported_modules(p) if module_path(t) is not None} for p in all_modules()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t == m or t in PACKAGE_INITS.get(m, ()):
                continue
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "circles among megarl's files:\n" + "\n".join(" -> ".join(c) for c in circles)


# a package's __init__ re-exports its modules, which import siblings through the package name:
# that edge (module -> its own package __init__) is not a circle of files
PACKAGE_INITS = {module_name(p): {module_name(p).rsplit(".", 1)[0]} for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("source,target,ok", [
    ("megarl.models.builder", "megarl.trainer.train_model", False),  # up, even inside a function
    ("megarl.rewards.math", "megarl.data.dataset", False),  # same layer, another package
    ("megarl.trainer.loop", "megarl.models.builder", True),
    ("megarl.config.loader", "megarl.config.errors", True),
])
def test_the_rule_itself(source, target, ok):
    src, dst = layer_of(source), layer_of(target)
    assert (dst[1] == src[1] or dst[0] < src[0]) == ok

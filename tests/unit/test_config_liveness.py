"""Every config field is live: changing it changes the run, or it is listed with the reason it
cannot be shown on CPU (or with the test that shows it). A new field with neither fails here.

The observations run in one subprocess (tests/distributed/scripts_liveness.py: world size 1,
gloo, megatron-core through the CPU runtime, the tiny model and task).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megarl.config.schema import MegaRLConfig
from tests.distributed import scripts_liveness as L
from tests.distributed.launch import REPO


def leaf_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from leaf_fields(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


FIELDS = sorted(leaf_fields(MegaRLConfig()))


def test_every_field_is_witnessed_or_excused():
    claimed = [set(L.WITNESSES), set(L.NOT_ON_CPU), set(L.SHOWN_ELSEWHERE)]
    unaccounted = sorted(set(FIELDS) - set().union(*claimed))
    assert not unaccounted, f"config fields with no liveness witness and no stated reason: {unaccounted}"
    assert not (set().union(*claimed) - set(FIELDS)), "witnesses for fields the schema no longer has"
    assert sum(len(c) for c in claimed) == len(set().union(*claimed)), "a field is listed twice"


def test_shown_elsewhere_names_existing_tests():
    for field, where in L.SHOWN_ELSEWHERE.items():
        path, _, name = where.split(" ")[0].partition("::")
        assert f"def {name}(" in (REPO / path).read_text(), (field, where)


def selected_fields(request) -> list[str]:
    """The fields of the witness tests this session runs (all of them, or those -k selected)."""
    return sorted({item.callspec.params["field"] for item in request.session.items
                   if item.module is request.module and "field" in getattr(getattr(item, "callspec", None), "params", {})})


@pytest.fixture(scope="module")
def observations(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("liveness")
    out = root / "out.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MEGARL_STRICT_DEVICE="1")
    only = selected_fields(request)
    only = only if len(only) < len(L.WITNESSES) else []  # none named: the script observes every field
    proc = subprocess.run([sys.executable, str(REPO / "tests/distributed/scripts_liveness.py"), str(root), str(out),
                           *only], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("field", sorted(L.WITNESSES))
def test_changing_the_field_changes_the_run(observations, field):
    """Observations are compared without identity (run-dir names, paths: scripts_liveness.normalise)."""
    obs = observations[field]
    assert obs["base"] != obs["changed"], f"{field}: {obs['base']}"

"""The GPU run's script (`benchmarks.gpu_run`, issue 59 item 6 and defect 14) as far as a CPU
shows it: the dependency check says what is missing and how to fix it, and unpacks carried
wheels without pip or an index; every stage's result is on disk as soon as it has it, so a
stage cut by its timeout leaves the ones before it; CUDA stages are skipped with the reason."""

from __future__ import annotations

import json
import sys
import time
import zipfile

from benchmarks import gpu_run


def _absent(*names, unless=None):
    """A find_spec that finds everything but `names` (found after all once `unless()` is true)."""
    def find_spec(module):
        if module in names and not (unless and unless()):
            return None
        return object()
    return find_spec


def test_a_missing_module_is_named_with_the_fix(tmp_path):
    deps = gpu_run.check_dependencies(find_spec=_absent("mpmath", "hypothesis", "matplotlib"),
                                      wheels=tmp_path / "none", site=tmp_path / "site")
    assert deps["missing"] == ["hypothesis", "mpmath"] and deps["installed"] == []
    assert "hypothesis mpmath" in deps["advice"] and "--fetch-wheels" in deps["advice"]
    assert "--no-index" in deps["advice"]
    assert "matplotlib" in deps["optional_missing"]
    assert gpu_run.check_dependencies(find_spec=_absent())["missing"] == []


def test_carried_wheels_are_unpacked_without_pip(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "mpmath-1.3.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("mpmath/__init__.py", "")
    with zipfile.ZipFile(wheels / "rich-15.0.0-py3-none-any.whl", "w") as wheel:  # importable already: left alone
        wheel.writestr("rich/__init__.py", "")
    deps = gpu_run.check_dependencies(find_spec=_absent("mpmath", unless=(site / "mpmath").exists),
                                      wheels=wheels, site=site)
    assert deps["missing"] == [] and deps["installed"] == ["mpmath"], deps
    assert (site / "mpmath" / "__init__.py").exists() and not (site / "rich").exists()
    assert sys.path[0] == str(site) and deps["site"] == str(site)


def test_each_result_is_written_as_soon_as_it_is_known(tmp_path):
    results = gpu_run.Results(tmp_path, {"device": "cpu"})
    python = sys.executable
    stages = [
        gpu_run.Stage("quick", [python, "-c", "print('done')"], 60),
        gpu_run.Stage("hangs", [python, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2),
        gpu_run.Stage("cuda-only", [python, "-c", "1"], 60, cuda=True),
        gpu_run.Stage("needs-mpmath", [python, "-c", "1"], 60, needs=("mpmath",)),
    ]
    deadline = time.monotonic() + 300
    rows = []
    for index, stage in enumerate(stages, 1):
        rows.append(gpu_run.run_stage(stage, index, results, deadline=deadline, cuda=False, missing=["mpmath"]))
        on_disk = json.loads((tmp_path / "summary.json").read_text())["stages"]
        assert [r["name"] for r in on_disk] == [s.name for s in stages[:index]]  # written before the next starts
    assert [r["status"] for r in rows] == ["passed", "timeout", "skipped", "failed"]
    assert "started" in (tmp_path / "02-hangs.log").read_text() and "cut at 2 s" in rows[1]["detail"]
    assert "no CUDA device" in rows[2]["detail"] and "missing module(s): mpmath" in rows[3]["detail"]
    assert "| hangs | timeout |" in (tmp_path / "summary.md").read_text()
    late = gpu_run.run_stage(stages[0], 5, results, deadline=time.monotonic() + 5, cuda=False)
    assert late["status"] == "skipped" and "budget" in late["detail"]


def test_results_go_to_out_or_reports_gpu():
    assert str(gpu_run.out_dir({"OUT": "/x/y"})) == "/x/y"
    assert gpu_run.out_dir({}) == gpu_run.REPO / "reports" / "gpu"


def test_the_run_covers_issue_64s_stages_and_fits_its_budget():
    """The audit first, then the first user's commands; every stage of issue 64 that can run
    without another issue's work (the context-parallel adapter is issue 64's own)."""
    names = [s.name for s in gpu_run.stages(gpu_run.REPO / "reports" / "gpu")]
    assert names[:3] == ["device-audit", "validate-cuda", "validate-cuda-triton"]
    for stage in ("suite-triton-backend", "suite-triton-variants", "probe-ring", "probe-long-shard",
                  "probe-torch-peak", "speed", "validate-32k", "step-model-llama", "step-model-ulysses"):
        assert stage in names
    assert gpu_run.BUDGET_S == 480

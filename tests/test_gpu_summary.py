"""scripts/gpu_summary.py, the per-goal GPU summary: each figure computed from the run's own files (the committed
H200 results, copied as a gpu_check.sh output directory would hold them), a goal no run measured null, a later run
replacing only what it measured, the first step and a profiled one left out of the step time, and a missing
directory refused in one line."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_summary  # noqa: E402

H200 = ROOT / "docs" / "results" / "gpu_h200_2026-11-26"
JUNIT = """<testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_a" time="1.0"/>
<testcase classname="tests.test_gpu" name="test_b" time="1.0"><failure message="boom"/></testcase>
<testcase classname="tests.test_gpu" name="test_c" time="1.0"><skipped message="no TE"/></testcase>
<testcase classname="tests.test_gpu" name="test_d" time="1.0"><error message="setup"/></testcase>
<testcase classname="tests.test_gpu" name="test_e" time="1.0"/>
</testsuite></testsuites>"""


def row(path, **match):
    return next(r for r in json.loads(path.read_text())["rows"] if all(r[k] == v for k, v in match.items()))


def test_a_run_fills_what_it_measured_and_a_later_run_only_its_own(tmp_path):
    first = tmp_path / "first"
    shutil.copytree(H200, first)
    summary = tmp_path / "summary.json"
    assert gpu_summary.main([str(first), "--summary", str(summary), "--date", "2026-11-26", "--commit", "aaa"]) == 0
    s = json.loads(summary.read_text())
    iso = row(first / "bench_step_gpu_single.json", impl="moe-gspo (megatron-core, SDPA)")
    rl = row(first / "bench_rl_gpu_single.json", size="gpu_single", tool="moe-gspo")
    assert s["fwd_bwd_vs_transformers"]["gpu_single"]["value"] == iso["speedup_vs_transformers"]
    assert s["rl_step_vs_trl"]["gpu_single"]["value"] == rl["speedup_vs_trl"]
    assert s["train_phase_fraction"]["gpu_single"]["value"] == rl["training_tokens_per_s"] / iso["tokens_per_s"]
    assert s["fwd_bwd_vs_transformers"]["gpu_2b"]["value"] > 0
    # measured by no run yet: null, not left out
    assert s["cuda_tests"] is None and s["gpu_single_step_s"] is None
    assert s["rl_step_vs_trl"]["gpu_2b"] is None and s["train_phase_fraction"]["gpu_2b"] is None
    assert (s["device"], s["date"], s["commit"]) == ("NVIDIA H200", "2026-11-26", "aaa")
    assert s["train_phase_fraction"]["gpu_single"]["source"] == ["bench_rl_gpu_single.json",
                                                                 "bench_step_gpu_single.json"]  # outside the repo

    # a later run with the tests stage and a configstep run (steps 1-5, step 3 profiled) on another GPU
    later = tmp_path / "later"
    (later / "train_float32" / "run").mkdir(parents=True)
    (later / "junit.xml").write_text(JUNIT)
    steps = [9.0, 1.5, 100.0, 1.1, 1.3]  # the warm-up first, the profiled third
    (later / "train_float32" / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "time/step": t}) + "\n" for i, t in enumerate(steps)))
    (later / "train_float32" / "run" / "profile_step_3.txt").write_text("profile\n")
    assert gpu_summary.main([str(later), "--summary", str(summary), "--date", "2026-12-01", "--commit", "bbb",
                             "--device", "NVIDIA H100 80GB HBM3"]) == 0
    s2 = json.loads(summary.read_text())
    assert s2["cuda_tests"]["value"] == {"passed": 2, "failed": 2, "skipped": 1}
    assert s2["gpu_single_step_s"]["value"] == statistics.median([1.5, 1.1, 1.3])
    assert s2["gpu_single_step_s"]["commit"] == "bbb" and s2["cuda_tests"]["device"] == "NVIDIA H100 80GB HBM3"
    assert s2["fwd_bwd_vs_transformers"] == s["fwd_bwd_vs_transformers"]  # kept from the run that measured it
    assert (s2["device"], s2["date"], s2["commit"]) == ("NVIDIA H100 80GB HBM3", "2026-12-01", "bbb")


def test_the_committed_summary_lists_every_goal():
    s = json.loads((ROOT / "docs" / "results" / "gpu_summary.json").read_text())
    for key, sizes in gpu_summary.KEYS.items():
        assert key in s, key
        if sizes is not None:
            assert set(s[key]) == set(sizes), key
    assert {"device", "date", "commit"} <= set(s)


def test_a_missing_directory_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path / "nope"),
                        "--summary", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope" in r.stderr, r.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("name", ["bench_step_gpu_single.json", "bench_rl_gpu_single.json"])
def test_a_run_without_the_default_row_measures_nothing_for_it(tmp_path, name):
    d = tmp_path / "run"
    d.mkdir()
    data = json.loads((H200 / name).read_text())
    data["rows"] = [r for r in data["rows"] if r.get("impl") != "moe-gspo (megatron-core, SDPA)"
                    and r.get("tool") != "moe-gspo"]
    (d / name).write_text(json.dumps(data))
    assert gpu_summary.measured([d]) == {}

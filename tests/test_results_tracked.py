"""The raw data docs/findings.md cites is in the repository, not only on the machine that ran it: every
`docs/results/<study>/` the findings name holds files git tracks, and every run directory under it has a tracked
metrics.jsonl. A .gitignore rule can keep them out of every clone while the tests that read them pass on the
machine that ran the studies."""

import re
import shutil
import subprocess

import pytest
from helpers import ROOT


def _tracked() -> set[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "docs/results"], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_every_results_folder_the_findings_name_is_tracked():
    tracked = _tracked()
    named = set(re.findall(r"docs/results/([a-z_0-9]+)/", (ROOT / "docs/findings.md").read_text()))
    assert len(named) >= 10
    for study in sorted(named):
        assert any(f.startswith(f"docs/results/{study}/") for f in tracked), f"docs/results/{study}/: nothing tracked"


def test_every_run_on_disk_under_docs_results_is_tracked():
    tracked = _tracked()
    runs = [p for p in (ROOT / "docs/results").glob("**/seed_*/metrics.jsonl")]
    assert len(runs) >= 400
    missing = [str(p.relative_to(ROOT)) for p in runs if str(p.relative_to(ROOT)) not in tracked]
    assert not missing, f"{len(missing)} run(s) on disk but not in git, e.g. {missing[:3]}"


def test_no_committed_result_names_a_machines_paths():
    """Logs, JSON summaries and configs under docs/results name files relative to the checkout: an absolute path
    of the machine that ran them (/work/..., /tmp/..., /home/..., /root/...) says nothing on another."""
    machine = re.compile(r"""["'\s:=(](/(?:work|tmp|home|root|scratch|workspace|mnt)/[^\s"']+)""")
    found = []
    for f in sorted(_tracked()):
        if f.endswith((".log", ".json", ".txt", ".md", ".yaml", ".csv")):
            text = (ROOT / f).read_text(errors="replace")
            found += [f"{f}: {m}" for m in machine.findall(" " + text)[:1]]
    assert not found, "\n".join(found)

"""An installed, non-editable wheel provides `moe_gspo.kernels` and no top-level `kernels` module (that import
name belongs to an unrelated PyPI package)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_maps_kernels_under_moe_gspo(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "whl"), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build without isolation here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / "whl").glob("moe_gspo-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "moe_gspo/kernels/__init__.py" in names and "moe_gspo/kernels/chunked.py" in names
    assert not any(n.startswith("kernels/") for n in names), "a top-level kernels package would shadow PyPI's"
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import sys; sys.path = [p for p in sys.path if p not in ('', '.', %r)]; sys.path.insert(0, %r); "
            "import moe_gspo.kernels as k; assert k.__file__.startswith(%r), k.__file__; "
            "import importlib.util; assert importlib.util.find_spec('kernels') is None; print('ok')"
            % (str(ROOT), str(target), str(target)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]

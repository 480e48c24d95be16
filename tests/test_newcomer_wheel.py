"""Issue 36, item 9: `python -m build` makes a wheel whose `pip install` gives a working
`moorline run`. The wheel is installed into a fresh virtual environment (with the system's
site-packages, so its dependencies are not downloaded again; `--no-index`, so nothing is), and the
node started from it must be the wheel's code, not this checkout's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from moorline.chaos.node import free_port

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_into_a_fresh_venv_and_runs_a_node(tmp_path: Path) -> None:
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list(dist.glob("moorline-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
    assert "moorline/node/edge/server.py" in names and "pyspark_moorline.py" in names
    # Every file the code reads beside its modules is in the wheel.
    data = [p for p in (REPO / "moorline").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in p.parts]
    missing = [str(p.relative_to(REPO)) for p in data if str(p.relative_to(REPO)) not in names]
    assert not missing, missing
    assert not any(n.startswith(("tests/", "bench/")) for n in names)

    # Another test may have put this checkout on PYTHONPATH for its own subprocesses: not for these.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120,
                   env=env)
    py = venv / "bin" / "python"
    installed = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check", "-q",
         str(wheels[0])], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    check = subprocess.run([str(py), "-m", "pip", "check"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env=env)
    assert check.returncode == 0, check.stdout + check.stderr  # its dependencies are all there
    where = subprocess.run([str(py), "-c", "import moorline; print(moorline.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, check=True, env=env).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel's moorline, not the checkout's

    mqtt_port, http_port = free_port(), free_port()
    log = tmp_path / "node.log"
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(
            [str(venv / "bin" / "moorline"), "run", "--data-dir", str(tmp_path / "data"),
             "--mqtt", f"127.0.0.1:{mqtt_port}", "--http", f"127.0.0.1:{http_port}"],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "moorline ready" not in log.read_text(encoding="utf-8"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(encoding="utf-8")[-3000:]
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/health", timeout=10) as r:
            assert r.status == 200 and isinstance(json.loads(r.read()), dict)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text(encoding="utf-8")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

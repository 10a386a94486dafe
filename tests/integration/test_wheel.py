"""A wheel built from this tree carries the kernels' builds: installed elsewhere, it serves with no compiler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fiberserve.kernels import variants
from tests.without_compiler import environment_without_compiler

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_serves_where_there_is_no_compiler(tmp_path, start_server):
    # The wheel reuses the install's compiled objects (build/kernels), so it only links here.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", tmp_path, ROOT],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("fiberserve-*.whl")
    assert wheel.name.endswith("linux_x86_64.whl")  # a platform wheel: it holds compiled code
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    builds = {path.name.split("_")[2] for path in (site / "fiberserve" / "kernels").glob("_kernels_*.so")}
    assert builds == {variant.name for variant in variants.PREBUILT}

    env = {**environment_without_compiler(tmp_path), "PYTHONPATH": str(site)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import fiberserve.kernels; print(fiberserve.kernels.__file__)"],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(site)

    server = start_server(env=env, cwd=elsewhere).wait_ready()
    try:
        with server.client() as client:
            r = client.post(
                "/v1/completions",
                json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
            )
            page = client.get("/")  # the chat page is in the wheel
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(" Paris") and choice["finish_reason"] == "length"
        assert page.status_code == 200 and "<title>fiberserve</title>" in page.text
    finally:
        assert server.stop() == 0
    log = server.log_path.read_text()
    assert "compiling" not in log and not (tmp_path / "extensions").exists(), log[-2000:]

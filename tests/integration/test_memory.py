"""Loading a model takes about its serving weights of memory: no float32 copy of the model, at any time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from memory_check import llama_shape, measure, write_model  # noqa: E402

from fiberserve.model.file_rows import CACHED_ROWS  # noqa: E402

MIB = 2**20


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_synthetic_model_loads_in_its_serving_weights_plus_a_little(tmp_path, kind):
    shape = llama_shape(0.4)  # 0.4B parameters: 1.6 GB in float32, far above what the bound below allows
    path = tmp_path / "synthetic.gguf"
    write_model(path, shape, kind)
    result = measure(path)
    over = result["rss_peak"] - result["rss_before"]
    # the file's own blocks and no copy of the embedding or the head: their rows are read from the file's blocks,
    # the distinct rows met lately kept in a small table (file_rows.py)
    table = CACHED_ROWS * shape["hidden"] * 2
    assert result["serving_bytes"] <= result["file_bytes"] + table + 32 * MIB
    assert over <= result["serving_bytes"] + 400 * MIB, {k: v / MIB for k, v in result.items() if "bytes" in k}


def test_mlock_keeps_the_served_weights_locked_in_memory(start_server, model_path):
    """``--mlock``: the serving process's locked memory holds its weights (the embedded model's blocks, some
    hundred MiB), and it serves as without the flag; the log names what was locked."""
    proc = start_server("--mlock").wait_ready()
    try:
        status = Path(f"/proc/{proc.proc.pid}/status").read_text()
        locked = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmLck:"))
        logged = proc.log_with("MiB of weights locked in memory")
        mib = float(logged.split("--mlock: ")[1].split(" MiB")[0])
        assert locked >= mib * MIB - MIB and mib >= 50, (locked, logged)
        with proc.client() as c:
            r = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
        proc.assert_idle()
    finally:
        assert proc.stop() == 0

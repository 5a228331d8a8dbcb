"""What loading a GGUF's weights (``gguf_weights.load``) leaves in the process's memory.

The blocks are copied into the kernel's panels; the file's pages they were read from must
not stay resident beside them (a mapped file's pages count in the process's RSS: for a
model of 0.5 GB that doubled the daemon's peak)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from ggufs import write_gguf

from codespec.daemon.engine import gguf_weights, quant_gemm


def _resident_kb(path: Path) -> int:
    """KB of ``path``'s mapped pages resident in this process (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
@pytest.mark.skipif(quant_gemm.library() is None, reason="no quantized kernel")
def test_loading_leaves_no_file_pages_resident(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", qtype="Q8_0", hidden=256, ffn=1024, layers=2)
    g = gguf_weights.read(path)
    for name in g.tensors:  # every page of the file in, as reading the blocks brings them
        assert int(np.asarray(g.raw(name)).sum()) >= 0
    before = _resident_kb(path)
    assert before * 1024 > 0.8 * path.stat().st_size
    weights = gguf_weights.load(g, gguf_weights.config_from_meta(g))
    assert _resident_kb(path) < before / 10
    assert weights.layers[0]["gu"][0][0].qtype == "Q8_0"  # the weights themselves stay

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


def test_qwen_05b_runs_from_its_own_blocks(request: pytest.FixtureRequest) -> None:
    """Qwen2.5-Coder-0.5B's GGUF (where this machine has it): nothing refused; its smallest
    matrix of each block type (Q5_0, Q8_0, Q4_K, Q6_K) gives back its bytes, widens on
    every path to gguf's dequantized weights and multiplies as they do; the model folder's
    runner is the lean one over the blocks, its LM head the file's own Q8_0 output matrix
    (not the Q5_0 embedding), and its logits are finite."""
    import gguf
    import torch
    from qwen_local import qwen_dir

    from codespec.daemon.engine import models
    from codespec.daemon.engine.lean import from_model_folder

    folder = qwen_dir(request)
    manifest = models.read_manifest(folder)
    path = models.CachedModel(folder, manifest).gguf if manifest else None
    if path is None:
        pytest.skip(f"{folder} keeps no GGUF")
    g = gguf_weights.read(path)
    assert gguf_weights.unsupported(g, gguf_weights.config_from_meta(g)) is None
    smallest: dict[str, gguf_weights.TensorInfo] = {}
    for t in g.tensors.values():
        if len(t.shape) == 2 and t.nbytes < smallest.get(t.type_name, t).nbytes + 1:
            smallest[t.type_name] = t
    assert set(smallest) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    gen = torch.Generator().manual_seed(0)
    for kind, t in smallest.items():
        k, n = t.shape
        raw = g.raw(t.name).reshape(n, -1)
        qm = quant_gemm.QuantMatrix.from_bytes(raw, kind, n, k)
        assert np.array_equal(qm.to_gguf_bytes(), raw), t.name
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
        for isa in quant_gemm.available_isas():
            assert np.array_equal(qm.dequantize(isa).numpy(), want), f"{t.name} {isa}"
        x = torch.randn(2, k, generator=gen)
        ref = x.double() @ torch.from_numpy(want).double().t()
        got = quant_gemm.linear(x, qm).double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, t.name
    got = from_model_folder(folder, max_length=64)
    assert got is not None
    runner = got[0]
    assert runner.gguf and runner.stack is not None
    assert runner.lm_head_t.qtype == "Q8_0" and runner._embed_q.qtype == "Q5_0"
    assert runner.lm_head_t.n == runner._embed_q.n == runner.vocab_size
    logits = runner.forward([151643, 750, 1477, 1445]).logits
    assert logits.shape == (4, runner.vocab_size) and torch.isfinite(logits).all()

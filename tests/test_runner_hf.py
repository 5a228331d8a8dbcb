"""The HF runner's cache verbs: rollback, keep and tree masks give fresh-prefill logits."""

from __future__ import annotations

import pytest
import torch

from codespec.daemon.engine.runner import HFRunner
from conftest import tiny_llama

ATOL = 1e-5


def test_incremental_equals_fresh_prefill():
    r = HFRunner(tiny_llama())
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    full = r.forward(ids).logits
    r.reset()
    parts = [r.forward(ids[:17]).logits, r.forward(ids[17:18]).logits, r.forward(ids[18:]).logits]
    assert torch.allclose(torch.cat(parts), full, atol=ATOL)


def test_rollback_then_refeed():
    r = HFRunner(tiny_llama())
    ids = list(range(1, 31))
    full = r.forward(ids).logits
    r.truncate(12)
    assert r.length == 12
    again = r.forward(ids[12:]).logits
    assert torch.allclose(again, full[12:], atol=ATOL)


def test_tree_then_keep_a_branch():
    """A tree with a wrong sibling; keeping the right branch equals a plain prefill."""
    r = HFRunner(tiny_llama())
    ids = [(7 * i + 3) % 96 for i in range(30)]
    full = r.forward(ids).logits
    r.truncate(20)
    tree = [ids[20], 5, ids[21], 9, ids[22]]
    parents = [-1, 0, 0, 2, 2]  # ids[20] -> {5, ids[21] -> {9, ids[22]}}
    out = r.forward(tree, parents).logits
    assert torch.allclose(out[[0, 2, 4]], full[20:23], atol=ATOL)
    r.keep([0, 2, 4])
    assert r.length == 23
    assert torch.allclose(r.forward(ids[23:]).logits, full[23:], atol=ATOL)


def test_keep_refuses_bad_indices():
    """keep() takes increasing indices into the tokens the last forward appended."""
    r = HFRunner(tiny_llama())
    r.forward([1, 2, 3, 4])
    for bad in ([0, 4], [2, 1], [1, 1]):
        with pytest.raises(ValueError, match="keep"):
            r.keep(bad)

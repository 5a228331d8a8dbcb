"""The lean runner on a GGUF's own blocks (``LeanRunner.from_gguf``, ``gguf_weights``).

Tiny random models written by the test itself with ``gguf.GGUFWriter`` (``tests/ggufs.py``):
llama (q/k rows permuted by llama.cpp's convention, un-permuted on load) with Q8_0, Q4_1,
Q4_K or Q6_K matrices, and qwen2 (q/k/v biases, no permutation) with Q4_1 matrices or
Qwen2.5-Coder-0.5B's mix (Q5_0, v Q8_0 so q/k/v are not fused, a Q5_1 ffn_down, a separate
Q8_0 LM head). gguf quantizes Q8_0, Q4_x and Q5_x itself; K-quant blocks are random
bytes with small random fp16 scales (gguf cannot quantize them), so the weights are what
gguf dequantizes them to.

Checked: logits within tolerance of transformers' model of the same file
(``from_pretrained(gguf_file=...)``, dequantized fp32) through prefill, decode, chains,
a tree with ``keep`` and ``truncate`` (bf16 attention: against transformers' model with the
same roundings in its attention); decode rows equal verify rows bit for bit (chain, tree,
after keep); every path below the best this CPU runs (the plain C++ one, AVX2 under
AVX-512), one or two threads and (bf16 attention) the CPU's own bf16 dot products or FMAs
give the very logits of the best path; the int8-activation option keeps rows bit-equal too
(it runs on every CPU: the int8 products have a plain C++ path, so no test skips for want
of AVX2 or VNNI; ``CODESPEC_QGEMM_ISA=scalar`` runs this file on it); the header parser
agrees with gguf's reader; a folder the model cache made from a GGUF loads from its
blocks, an unsupported one is refused with a reason; the fast tokenizer answers as
``AutoTokenizer`` does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ggufs import write_gguf  # noqa: E402

from codespec.daemon.engine import gguf_weights, qstack, quant_gemm  # noqa: E402
from codespec.daemon.engine.engine import HEAD_FIRST_ROWS  # noqa: E402
from codespec.daemon.engine.lean import LeanRunner, from_model_folder  # noqa: E402
from codespec.daemon.engine.lean_config import attention_for, gguf_products  # noqa: E402
from codespec.daemon.engine.row_split import calibrate, row_switch  # noqa: E402
from codespec.daemon.engine.runner import HFRunner  # noqa: E402
from codespec.speculators.draft import Draft  # noqa: E402
from codespec.speculators.verify import verify_greedy  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        quant_gemm.library() is None,
        reason=f"the quantized kernel cannot be built here: {quant_gemm.unavailable_reason()}",
    ),
]

SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)  # K-quants need k % 256
KQUANT_SCALE = {"Q4_K": 2e-4, "Q6_K": 4e-5}  # d: weights of ~0.05, as the others


def _random_kquant(data: np.ndarray, qt, rng: np.random.Generator) -> np.ndarray:
    """Random ``qt`` blocks for a (rows, k) matrix, scales small enough for sane weights."""
    name = qt.name
    bk, size = quant_gemm.BLOCKS[name]
    rows, k = data.shape
    raw = rng.integers(0, 256, size=(rows, k // bk, size), dtype=np.uint8)
    scale = KQUANT_SCALE[name]
    d = (np.abs(rng.standard_normal((rows, k // bk, 1))) * scale).astype(np.float16)
    if name == "Q6_K":
        raw[..., 208:210] = d.view(np.uint8)
    else:
        raw[..., 0:2] = d.view(np.uint8)
        raw[..., 2:4] = (d * 8).astype(np.float16).view(np.uint8)  # dmin
    return raw.reshape(rows, k // bk * size)


# Other block types by tensor kind, per main type (``write_gguf``'s ``types``).
MIXES = {"Q5_0": {"attn_v": "Q8_0", "ffn_down": "Q5_1", "output": "Q8_0"}}


def _write(path: Path, qtype: str, arch: str = "llama", seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if qtype not in KQUANT_SCALE:
        mix = MIXES.get(qtype)
        return write_gguf(path, arch=arch, qtype=qtype, seed=seed, mix=mix, **SHAPE)
    real = gguf.quants.quantize
    rng = np.random.default_rng(seed)

    def quantize(data, qt):
        return _random_kquant(data, qt, rng) if qt.name in KQUANT_SCALE else real(data, qt)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", quantize)
        return write_gguf(path, arch=arch, qtype=qtype, seed=seed, **SHAPE)


def _reference(path: Path, attention: str = "fp32") -> HFRunner:
    """transformers' model of the GGUF; ``attention="bf16"``: its attention replaced by
    :func:`_bf16_attention`, the stack's bf16 attention in float64."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    if attention == "bf16":
        AttentionInterface.register("codespec_bf16", _bf16_attention)
        model.set_attn_implementation("codespec_bf16")
    return HFRunner(model.eval())


def _bf16_attention(module, query, key, value, attention_mask, scaling, **_):
    """What the stack's bf16 attention computes, in float64 from transformers' q, k, v:
    q (scaled), k and v rounded to bf16; per chunk of 128 keys of a row's key list, the
    weights exp(s - chunk max) rounded to bf16 and summed as rounded; chunks merged."""

    def bf(x: torch.Tensor) -> torch.Tensor:
        return x.float().to(torch.bfloat16).to(torch.float64)

    b, nh, t, d = query.shape
    group = nh // key.shape[1]
    q = bf(query.float() * scaling)
    k = bf(key).repeat_interleave(group, dim=1)
    v = bf(value).repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2)  # (B, NH, T, S)
    n = k.shape[2]
    if attention_mask is None:
        seen = torch.ones(t, n, dtype=torch.bool).tril(n - t)[None, None]
    elif attention_mask.dtype == torch.bool:
        seen = attention_mask
    else:
        seen = attention_mask == 0
    out = torch.zeros(b, nh, t, d, dtype=torch.float64)
    for bi, h, r in np.ndindex(b, nh, t):
        keys = seen[bi if seen.shape[0] > 1 else 0, 0, r].nonzero().flatten()
        parts = []
        for c in range(0, len(keys), 128):
            idx = keys[c : c + 128]
            sc = s[bi, h, r, idx]
            m = sc.max()
            p = bf(torch.exp(sc - m))
            parts.append((m, p.sum(), p @ v[bi, h, idx]))
        top = max(m for m, _, _ in parts)
        num = sum(o * torch.exp(m - top) for m, _, o in parts)
        den = sum(l_ * torch.exp(m - top) for m, l_, _ in parts)
        out[bi, h, r] = num / den
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


ATTENTIONS = ["fp32", "bf16"]  # the stack's (qstack.ATTENTION)
CASES = [("llama", "Q8_0"), ("llama", "Q4_1"), ("llama", "Q4_K"), ("llama", "Q6_K")]
CASES += [("qwen2", "Q4_1"), ("qwen2", "Q5_0")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def model_file(request, tmp_path_factory) -> Path:
    arch, qtype = request.param
    folder = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    return _write(folder / "tiny.gguf", qtype, arch)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within 2% of the logits' spread (seen: up to 1%): the fp16 KV cache and fp32 sums
    in other orders than transformers' (a wrong weight, row or permutation is off by
    about the spread itself)."""
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=2e-2 * float(b.std()) + 1e-4, rtol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_match_transformers(model_file: Path, attention: str) -> None:
    """Prefill, decode steps, a chain, a tree + keep, truncate: each forward's logits as
    transformers computes them from the same GGUF; with bf16 attention, as transformers'
    model with its attention replaced by the same roundings (``_bf16_attention``)."""
    lean = LeanRunner.from_gguf(model_file, max_length=128, attention=attention)
    hf = _reference(model_file, attention)
    assert lean.stack is not None and lean.gguf
    v = lean.vocab_size

    def both(ids, parents=None):
        got, ref = lean.forward(ids, parents).logits, hf.forward(ids, parents).logits
        if attention == "fp32":
            _close(got, ref)
        else:  # the same roundings: near nothing, but where a value sits at a bf16 rounding
            # boundary (transformers' fp32 sums differ in the last bit) it may round the
            # other way: seen up to 2.4% of the spread in one logit, 0.0x% on the mean
            err, spread = (got - ref).abs(), float(ref.std())
            assert float(err.max()) <= 3e-2 * spread + 1e-4
            assert float(err.mean()) <= 2e-3 * spread
        assert lean.length == hf.length

    both(_ids(20, 1, v))
    for tok in _ids(3, 2, v):
        both([tok])
    both(_ids(6, 3, v))
    both(_ids(7, 4, v), [-1, 0, 0, 1, 2, 2, -1])
    lean.keep([0, 2, 5])
    hf.keep([0, 2, 5])
    both([5])
    lean.truncate(10)
    hf.truncate(10)
    both(_ids(4, 5, v))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_decode_rows_equal_verify_rows(model_file: Path, attention: str) -> None:
    """A verify forward's rows (chain or tree) equal the decode steps at their places bit
    for bit, and the cache a tree leaves after keep equals the decoded one."""
    lean = LeanRunner.from_gguf(model_file, max_length=160, attention=attention)
    v = lean.vocab_size
    prompt, draft = _ids(130, 6, v), _ids(9, 7, v)  # past a 128-key chunk boundary
    lean.forward(prompt)
    verify = lean.forward(draft).logits
    lean.truncate(len(prompt))
    decode = torch.cat([lean.forward([t]).logits for t in draft])
    assert torch.equal(verify, decode)
    lean.truncate(len(prompt))
    lib = quant_gemm.library()
    gathered = lib.cs_lean_att_gathered() if lib is not None else 0
    tree = lean.forward(draft[:6], [-1, 0, 0, 2, -1, 4]).logits  # paths 0-2-3 and 4-5
    if lib is not None:
        # tokens 2 to 5 see other keys than the cache's rows in order: each gathers its
        # keys of the chunk past the cache (128-255) into its own tiles, one tile of 16
        # (it sees at most 2 + 3 of them), not the chunk's 8
        tiles = 4 * lean.num_layers * lean.n_kv
        assert lib.cs_lean_att_gathered() - gathered == 16 * tiles
    lean.keep([0, 2, 3])
    after = lean.forward([draft[6]]).logits
    lean.truncate(len(prompt))
    path = torch.cat([lean.forward([draft[i]]).logits for i in (0, 2, 3, 6)])
    assert torch.equal(tree[[0, 2, 3]], path[:3])
    assert torch.equal(after, path[3:])
    lean.truncate(len(prompt))
    assert torch.equal(lean.forward(draft[4:6], [-1, 0]).logits, tree[4:6])
    # a branch off a chain: its keys gather pairs of rows that lie side by side (130, 131)
    # and ones that do not (132 with 135)
    lean.truncate(len(prompt))
    branch = lean.forward(draft[:6], [-1, 0, 1, 2, 3, 2]).logits
    lean.keep([0, 1, 2, 5])
    after = lean.forward([draft[6]]).logits
    lean.truncate(len(prompt))
    path = torch.cat([lean.forward([draft[i]]).logits for i in (0, 1, 2, 5, 6)])
    assert torch.equal(branch[[0, 1, 2, 5]], path[:4])
    assert torch.equal(after, path[4:])


def _run(runner: LeanRunner, v: int) -> list[torch.Tensor]:
    out = [runner.forward(_ids(40, 8, v)).logits, runner.forward([3]).logits]
    out.append(runner.forward(_ids(5, 9, v), [-1, 0, 0, 1, -1]).logits)
    runner.keep([0, 1, 3])
    out.append(runner.forward(_ids(2, 10, v)).logits)
    return out


def _lesser_isas() -> list[str]:
    """The paths this CPU runs below its best (the portable one first)."""
    return quant_gemm.available_isas()[:-1] if quant_gemm.library() is not None else []


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("isa", _lesser_isas())
def test_fallback_paths_give_the_same_logits(
    model_file: Path, isa: str, attention: str, monkeypatch
) -> None:
    """CODESPEC_QGEMM_ISA forces the products' and the stack's path: every other path this
    CPU runs (the plain C++ one, and AVX2 where AVX-512 is the default) gives the very
    logits of the default path (with bf16 attention: FMAs in vdpbf16ps's order where the
    default path may run vdpbf16ps)."""
    best = LeanRunner.from_gguf(model_file, max_length=96, attention=attention)
    ref = _run(best, best.vocab_size)
    monkeypatch.setenv(quant_gemm.ISA_ENV, isa)
    forced = LeanRunner.from_gguf(model_file, max_length=96, attention=attention)
    for a, b in zip(_run(forced, forced.vocab_size), ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_threads_change_nothing(model_file: Path, attention: str) -> None:
    """One or two threads (products and attention split differently): the same logits."""
    runner = LeanRunner.from_gguf(model_file, max_length=96, attention=attention)
    one = _run(runner, runner.vocab_size)
    runner.reset()
    torch.set_num_threads(2)
    try:
        two = _run(runner, runner.vocab_size)
    finally:
        torch.set_num_threads(1)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def _run_long(runner: LeanRunner, threads: int) -> list[torch.Tensor]:
    """From an empty cache on ``threads`` threads: a prefill over several 128-key chunks
    (the last one partial), a decode step, a chain, a tree + keep (gathered keys), a chain."""
    v = runner.vocab_size
    runner.reset()
    torch.set_num_threads(threads)
    try:
        out = [runner.forward(_ids(300, 15, v)).logits, runner.forward([3]).logits]
        out.append(runner.forward(_ids(9, 16, v)).logits)
        out.append(runner.forward(_ids(5, 9, v), [-1, 0, 0, 1, -1]).logits)
        runner.keep([0, 1, 3])
        out.append(runner.forward(_ids(2, 10, v)).logits)
        return out
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_prefetch_changes_no_number(model_file: Path, attention: str) -> None:
    """Attention's software prefetch of a chunk's keys and values (off, 1 line ahead, the
    default, past the chunk's end) is a memory hint: prefill over several chunks (the last
    one partial), decode steps, chains and trees give the same logits bit for bit."""
    lib = quant_gemm.library()
    assert lib is not None
    before = lib.cs_lean_att_ahead(0)
    try:
        runner = LeanRunner.from_gguf(model_file, max_length=352, attention=attention)
        ref = _run_long(runner, 1)
        for ahead in (1, before, 10_000):
            lib.cs_lean_att_ahead(ahead)
            for threads in (1, 2):
                got = _run_long(runner, threads)
                for a, b in zip(got, ref, strict=True):
                    assert torch.equal(a, b), f"ahead={ahead} threads={threads}"
    finally:
        lib.cs_lean_att_ahead(before)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_tasks_fetch_their_next_tasks_keys_and_change_no_number(
    model_file: Path, attention: str
) -> None:
    """With int8 products (one parallel region) an attention task of several passes fetches
    the keys and values of its thread's next task along them (cs_lean_att_lead lines a
    step); a one-pass task (a decode step) does not. Off, 1 and 4 lines a step, 1 and 2
    threads: the same logits bit for bit."""
    lib = quant_gemm.library()
    assert lib is not None
    before = lib.cs_lean_att_lead(0)
    try:
        runner = LeanRunner.from_gguf(model_file, max_length=352, attention=attention, int8=True)
        v = runner.vocab_size
        ref = _run_long(runner, 1)
        for lead in (1, 4):
            lib.cs_lean_att_lead(lead)
            for threads in (1, 2):
                got = _run_long(runner, threads)
                for a, b in zip(got, ref, strict=True):
                    assert torch.equal(a, b), f"lead={lead} threads={threads}"
        lib.cs_lean_att_lead(1)
        runner.reset()
        runner.forward(_ids(300, 15, v))
        led = lib.cs_lean_att_led()
        runner.forward([3])  # one pass a task: nothing fetched ahead
        assert lib.cs_lean_att_led() == led
        runner.forward(_ids(16, 16, v))  # 3 chunks of keys, tasks of several passes
        assert lib.cs_lean_att_led() > led
        runner.truncate(301)
        lib.cs_lean_att_lead(0)
        led = lib.cs_lean_att_led()
        runner.forward(_ids(16, 16, v))
        assert lib.cs_lean_att_led() == led
    finally:
        lib.cs_lean_att_lead(before)


def test_bf16_attention_on_the_cpus_own_dot_products_equals_the_fmas(model_file: Path) -> None:
    """Where the CPU has AVX512-BF16, bf16 attention through vdpbf16ps gives the very
    logits of the same path through FMAs (cs_lean_bf16_native(0)): prefill over several
    128-key chunks, decode, chain, tree + keep (gathered keys), one and two threads."""
    lib = quant_gemm.library()
    assert lib is not None
    before = lib.cs_lean_bf16_native(1)
    try:
        if not lib.cs_lean_bf16_native(-1):
            pytest.skip("this CPU has no AVX512-BF16")
        runner = LeanRunner.from_gguf(model_file, max_length=352, attention="bf16")
        native = _run_long(runner, 1)
        lib.cs_lean_bf16_native(0)
        for threads in (1, 2):
            for a, b in zip(_run_long(runner, threads), native, strict=True):
                assert torch.equal(a, b), f"threads={threads}"
    finally:
        lib.cs_lean_bf16_native(before)


def test_attention_follows_the_products_unless_asked(monkeypatch) -> None:
    """bf16 attention with int8 products (the inexact path) where the CPU has its own bf16
    dot products, fp32 with the exact ones or without them; CODESPEC_ATTENTION chooses, a
    bad name is an error naming the choices."""
    monkeypatch.delenv("CODESPEC_ATTENTION", raising=False)
    assert attention_for(True) == ("bf16" if qstack.native_bf16() else "fp32")
    assert attention_for(False) == "fp32"
    monkeypatch.setenv(quant_gemm.ISA_ENV, "scalar")  # FMAs would stand in: not chosen
    assert attention_for(True) == "fp32"
    monkeypatch.delenv(quant_gemm.ISA_ENV)
    monkeypatch.setenv("CODESPEC_ATTENTION", "fp32")
    assert attention_for(True) == "fp32"
    monkeypatch.setenv("CODESPEC_ATTENTION", "BF16")
    assert attention_for(False) == "bf16"
    monkeypatch.setenv("CODESPEC_ATTENTION", "fast")
    with pytest.raises(ValueError, match="bf16"):
        attention_for(True)


def test_thread_shares_change_no_number(model_file: Path) -> None:
    """With two threads the one-region forward gives thread 0 a fraction of each product's
    panels (moved after each forward toward the one that balances the threads' time in the
    products): any fraction gives the same logits bit for bit as halves and as one
    thread (0.3, 0.45 and 0.6 cut the 16- and 8-panel matrices inside a group of four
    panels, leaving each thread 1, 2 or 3 of it: the passes over part of a group);
    adapting moves it within 0.25-0.75 and only for two threads."""
    lib = quant_gemm.library()
    assert lib is not None

    def run(runner: LeanRunner, threads: int) -> list[torch.Tensor]:
        runner.reset()
        torch.set_num_threads(threads)
        try:
            return _run(runner, runner.vocab_size)
        finally:
            torch.set_num_threads(1)

    runner = LeanRunner.from_gguf(model_file, max_length=96, int8=True)
    adapt, split = lib.cs_lean_split_adapt(0), lib.cs_lean_split(0.5)
    try:
        ref = run(runner, 1)
        for f in (0.5, 0.25, 0.75, 0.3, 0.45, 0.6, 0.0, 1.0):
            lib.cs_lean_split(f)
            for a, b in zip(run(runner, 2), ref, strict=True):
                assert torch.equal(a, b), f"split={f}"
            assert lib.cs_lean_split(f) == f  # fixed while not adapting
        lib.cs_lean_split_adapt(1)
        lib.cs_lean_split(0.5)
        run(runner, 1)
        assert lib.cs_lean_split(0.5) == 0.5  # one thread: nothing to balance
        got = run(runner, 2)
        moved = lib.cs_lean_split(0.5)
        assert 0.25 <= moved <= 0.75 and moved != 0.5
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b)
    finally:
        lib.cs_lean_split_adapt(adapt)
        lib.cs_lean_split(split)


def test_the_row_switch_is_where_rows_stop_being_slower() -> None:
    def best(rows_faster: dict[int, bool]) -> dict[tuple[int, bool], float]:
        return {
            (t, rows): 1.0 if rows == faster else 2.0
            for t, faster in rows_faster.items()
            for rows in (True, False)
        }

    assert row_switch(best({8: True, 16: True, 32: True})) == 8
    assert row_switch(best({8: False, 16: False, 32: True})) == 32
    assert row_switch(best({8: True, 16: False, 32: True})) == 32  # never slower from 32
    assert row_switch(best({8: True, 16: True, 32: False})) == 64  # none: a prefill's rows
    assert row_switch({(8, True): 1.0, (8, False): 1.0}) == 8  # a tie goes by rows


def test_calibrating_the_row_switch_sets_it_and_leaves_the_cache_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibrating times the runner's small forwards both ways and sets the stack's
    switch to what it chose (one of the sizes, or twice the largest); it leaves the
    cache empty and the numbers alone; a short max_length shrinks the sizes and the
    context. Exact products, one thread, CODESPEC_ROW_SPLIT set, or no size that fits:
    nothing is chosen."""
    lib = quant_gemm.library()
    assert lib is not None
    runner = LeanRunner.from_gguf(_write(tmp_path / "t.gguf", "Q8_0"), max_length=128, int8=True)
    v = runner.vocab_size
    before = lib.cs_lean_row_split(-1)
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("CODESPEC_ROW_SPLIT", raising=False)
        torch.set_num_threads(1)
        assert calibrate(runner, sizes=(4, 8), context=16) is None
        torch.set_num_threads(2)
        ref = runner.forward(_ids(20, 3, v)).logits
        lib.cs_lean_row_split(5)
        got = calibrate(runner, sizes=(4, 8), reps=2, context=16)
        assert got in (4, 8, 16)
        assert lib.cs_lean_row_split(-1) == got
        assert runner.length == 0
        assert torch.equal(runner.forward(_ids(20, 3, v)).logits, ref)
        runner.reset()
        short = LeanRunner.from_gguf(_write(tmp_path / "s.gguf", "Q8_0"), max_length=20, int8=True)
        assert calibrate(short) in (8, 16)  # 8 tokens after 12: what fits in 20
        assert short.length == 0
        tiny = LeanRunner.from_gguf(_write(tmp_path / "u.gguf", "Q8_0"), max_length=12, int8=True)
        assert calibrate(tiny) is None  # no size fits twice
        exact = LeanRunner.from_gguf(_write(tmp_path / "e.gguf", "Q8_0"), max_length=128)
        assert calibrate(exact, sizes=(4, 8), context=16) is None  # never shared by rows
        monkeypatch.setenv("CODESPEC_ROW_SPLIT", "8")
        lib.cs_lean_row_split(5)
        assert calibrate(runner, sizes=(4, 8), context=16) is None
        assert lib.cs_lean_row_split(-1) == 5
    finally:
        torch.set_num_threads(threads)
        lib.cs_lean_row_split(before)


def test_sharing_out_by_rows_changes_no_number(model_file: Path) -> None:
    """From cs_lean_row_split's token count on, two threads take a forward's tokens apart
    (each through every product, its own attention tasks, one barrier a layer) instead of
    each product's panels: the same logits, taps (hidden states) and greedy stops bit for
    bit as by panels and as one thread, for a prefill, chains, a tree whose branches fall
    on both sides of the cut and any cut the thread shares give (0.25 / 0.75 of two), and
    on three threads (two cuts)."""
    lib = quant_gemm.library()
    assert lib is not None
    runner = LeanRunner.from_gguf(model_file, max_length=128, int8=True)
    v, taps = runner.vocab_size, (1, runner.num_layers)
    tree = [-1, 0, 1, 2, 0, 4, 5, -1, 7, 8, 3, 10]

    def run(threads: int) -> list[torch.Tensor]:
        runner.reset()
        torch.set_num_threads(threads)
        try:
            outs = [
                runner.forward(_ids(40, 8, v), taps=taps),
                runner.forward([3], taps=taps),
                runner.forward(_ids(12, 9, v), tree, taps=taps),
            ]
            runner.keep([0, 1, 2, 3, 10, 11])
            outs.append(runner.forward(_ids(16, 10, v), taps=taps))
            outs.append(runner.forward(_ids(5, 11, v), greedy=True))
        finally:
            torch.set_num_threads(1)
        got = []
        for o in outs:
            got.append(o.logits)
            if o.hidden is not None:
                got.append(o.hidden)
            if o.best is not None:
                got.append(torch.tensor(o.best))
        return got

    before, adapt = lib.cs_lean_row_split(0), lib.cs_lean_split_adapt(0)
    split = lib.cs_lean_split(0.5)
    try:
        by_rows = lib.cs_lean_row_forwards()
        ref = run(1)
        for a, b in zip(run(2), ref, strict=True):
            assert torch.equal(a, b), "by panels"
        assert lib.cs_lean_row_forwards() == by_rows  # 0: never by rows
        for rows_from, f, shared in ((2, 0.5, 4), (8, 0.5, 3), (2, 0.25, 4), (2, 0.75, 4)):
            lib.cs_lean_row_split(rows_from)
            lib.cs_lean_split(f)
            for a, b in zip(run(2), ref, strict=True):
                assert torch.equal(a, b), f"by rows from {rows_from} tokens, split {f}"
            assert lib.cs_lean_row_forwards() - by_rows == shared  # those of rows_from tokens
            by_rows = lib.cs_lean_row_forwards()
        for a, b in zip(run(3), ref, strict=True):  # three threads: two cuts
            assert torch.equal(a, b), "by rows on three threads"
        assert lib.cs_lean_row_forwards() - by_rows == 4
        by_rows = lib.cs_lean_row_forwards()
        run(1)
        assert lib.cs_lean_row_forwards() == by_rows  # one thread: nothing to share
    finally:
        lib.cs_lean_row_split(before)
        lib.cs_lean_split_adapt(adapt)
        lib.cs_lean_split(split)


def test_forwards_by_rows_keep_a_share_of_their_own(model_file: Path) -> None:
    """Two threads' cut of a forward shared out by rows adapts from such forwards only: a
    decode step (by panels) moves the panels' fraction and leaves the rows' one as it was
    (a step's product balance used to move the next verification's cut), and a forward by
    rows moves the rows' one and leaves the panels'."""
    lib = quant_gemm.library()
    assert lib is not None
    runner = LeanRunner.from_gguf(model_file, max_length=96, int8=True)
    v = runner.vocab_size
    rows_from, adapt = lib.cs_lean_row_split(8), lib.cs_lean_split_adapt(1)
    split, share = lib.cs_lean_split(0.5), lib.cs_lean_row_share(-1)
    torch.set_num_threads(2)
    try:
        runner.reset()
        runner.forward(_ids(4, 8, v))  # 4 tokens: by panels
        for step in range(3):
            runner.forward([step + 3])
        assert lib.cs_lean_row_share(-1) == 0.5
        assert lib.cs_lean_split(0.5) != 0.5
        by_rows = lib.cs_lean_row_forwards()
        runner.forward(_ids(16, 9, v))
        assert lib.cs_lean_row_forwards() == by_rows + 1
        moved = lib.cs_lean_row_share(-1)
        assert 0.25 <= moved <= 0.75 and moved != 0.5
        assert lib.cs_lean_split(0.5) == 0.5  # (it sets both fractions: read the rows' first)
    finally:
        torch.set_num_threads(1)
        lib.cs_lean_row_split(rows_from)
        lib.cs_lean_split_adapt(adapt)
        lib.cs_lean_split(split)
        lib.cs_lean_row_share(share)


def test_forwards_by_rows_do_not_meet_at_every_layer(tmp_path: Path) -> None:
    """Shared out by tokens, a forward's threads do not all meet before each layer's
    attention (each waits only for the keys of the threads before it): its barrier rounds
    do not grow with the layers, where by panels they grow by several a layer."""
    lib = quant_gemm.library()
    assert lib is not None
    rounds: dict[tuple[int, int], int] = {}
    rows_from = lib.cs_lean_row_split(8)
    torch.set_num_threads(2)
    try:
        for layers in (2, 6):
            shape = {**SHAPE, "layers": layers}
            path = write_gguf(tmp_path / f"l{layers}.gguf", qtype="Q4_1", **shape)
            runner = LeanRunner.from_gguf(path, max_length=64, int8=True)
            for split in (8, 0):  # by tokens from 8, never
                lib.cs_lean_row_split(split)
                runner.reset()
                runner.forward(_ids(20, 3, runner.vocab_size))
                before = lib.cs_lean_barrier_rounds()
                runner.forward(_ids(16, 4, runner.vocab_size))
                rounds[(layers, split)] = lib.cs_lean_barrier_rounds() - before
    finally:
        torch.set_num_threads(1)
        lib.cs_lean_row_split(rows_from)
    assert rounds[(6, 0)] - rounds[(2, 0)] >= 4 * 4  # by panels: several a layer
    assert rounds[(6, 8)] == rounds[(2, 8)]  # by tokens: none a layer


def test_int8_products_keep_rows_equal(tmp_path: Path) -> None:
    """int8=True (x rounded to int8 for the block products, llama.cpp's way): its verify
    rows still equal its decode rows bit for bit, and its logits stay near the exact ones."""
    path = _write(tmp_path / "q.gguf", "Q4_1")
    exact = LeanRunner.from_gguf(path, max_length=64)
    fast = LeanRunner.from_gguf(path, max_length=64, int8=True)
    v = fast.vocab_size
    ids = _ids(30, 11, v)
    ref = exact.forward(ids).logits
    got = fast.forward(ids).logits
    assert not torch.equal(got, ref)
    err = (got - ref).abs()  # x's rounding, through 2 random layers: ~2% mean, 10% worst
    assert float(err.mean()) < 0.05 * float(ref.std())
    assert float(err.max()) < 0.3 * float(ref.std())
    draft = _ids(5, 12, v)
    verify = fast.forward(draft).logits
    fast.truncate(len(ids))
    assert torch.equal(verify, torch.cat([fast.forward([t]).logits for t in draft]))


def test_one_region_forward_equals_a_region_per_product(model_file: Path, monkeypatch) -> None:
    """int8 products run the whole forward in one parallel region with the stack's own
    barriers (spinning, or sleeping on a busy machine); the logits, taps and cache equal
    those of the forward that opens a region per product, for 1, 2 and 3 threads (3 on
    this 2-core machine: threads descheduled at the barriers), chains and trees."""

    def run(runner: LeanRunner) -> list[torch.Tensor]:
        v = runner.vocab_size
        out = _run(runner, v)
        out.append(runner.forward(_ids(3, 13, v), taps=(0, 1)).hidden)
        out.append(runner.forward(_ids(4, 14, v), last_only=True).logits)
        return out

    lib = quant_gemm.library()
    assert lib is not None
    monkeypatch.setenv("CODESPEC_LEAN_REGIONS", "per-product")
    ref = run(LeanRunner.from_gguf(model_file, max_length=96, int8=True))
    monkeypatch.delenv("CODESPEC_LEAN_REGIONS")
    for threads in (1, 2, 3):
        before = lib.cs_lean_team_forwards()
        torch.set_num_threads(threads)
        try:
            got = run(LeanRunner.from_gguf(model_file, max_length=96, int8=True))
        finally:
            torch.set_num_threads(1)
        assert lib.cs_lean_team_forwards() > before  # the one-region path ran
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b), f"threads={threads}"


def test_a_long_forward_that_waits_does_not_stop_the_decode_steps_spinning(
    monkeypatch,
) -> None:
    """The one-region forward's barriers spin, and sleep at once for a while after a
    forward whose waits outlasted the spin (a busy machine). A prefill's waits outlast it
    because its steps are long: that must not turn spinning off for the decode steps after
    it (it did, and each decode step then slept at its ~330 barriers: 3x slower on an idle
    machine). Forwards of 1, up to 16 by panels, up to 16 by rows, up to 64 and more tokens
    learn apart, and a longer forward spins longer (its threads' shares are longer, and so
    are their waits)."""
    lib = quant_gemm.library()
    if lib is None:
        pytest.skip("no quantized kernel")
    monkeypatch.delenv("CODESPEC_SPIN_US", raising=False)
    lib.cs_lean_spin_reset()  # (earlier tests ran 3 threads on 2 cores: they slept)
    row_split = lib.cs_lean_row_split(8)  # by rows from 8 tokens (the default)
    try:
        spin = lib.cs_lean_spin_ns(1)
        assert spin > 0
        trips = lib.cs_lean_spin_trips(1000), lib.cs_lean_spin_trips(1)
        lib.cs_lean_spin_observe(1000, spin, 330, 200)  # a prefill: most waits slept
        assert (lib.cs_lean_spin_trips(1000), lib.cs_lean_spin_trips(1)) == (
            trips[0] + 1,
            trips[1],
        )
        assert lib.cs_lean_spin_ns(1000) == 0  # the next prefills sleep at once
        assert lib.cs_lean_spin_ns(65) == 0
        assert lib.cs_lean_spin_ns(1) == spin  # the decode steps still spin
        assert lib.cs_lean_spin_ns(16) == 4 * spin  # and the verifications, longer
        assert lib.cs_lean_spin_ns(64) == 16 * spin
        assert (lib.cs_lean_spin_ns(4), lib.cs_lean_spin_ns(8)) == (spin, 2 * spin)
        # a verification shared out by rows, over one wait in 8: its later thread waits for
        # the earlier one's keys at every layer because that is their order, and the small
        # drafts' forwards by panels after it must still spin (they slept, ~2x as long)
        lib.cs_lean_spin_observe(16, spin, 330, 42)
        assert (lib.cs_lean_spin_ns(16), lib.cs_lean_spin_ns(8)) == (0, 0)
        assert (lib.cs_lean_spin_ns(2), lib.cs_lean_spin_ns(7)) == (spin, spin)
        lib.cs_lean_spin_observe(4, spin, 330, 42)  # a small verification by panels
        assert (lib.cs_lean_spin_ns(2), lib.cs_lean_spin_ns(7)) == (0, 0)
        assert lib.cs_lean_spin_ns(1) == spin
        lib.cs_lean_spin_observe(64, spin, 330, 42)
        assert lib.cs_lean_spin_ns(17) == 0
        lib.cs_lean_spin_observe(1, spin, 330, 41)  # one wait in 8 or fewer: still spins
        assert lib.cs_lean_spin_ns(1) == spin
        lib.cs_lean_spin_observe(1, spin, 330, 42)  # decode steps that waited: now they sleep
        assert lib.cs_lean_spin_ns(1) == 0
        lib.cs_lean_spin_reset()
        lib.cs_lean_spin_observe(1, 0, 330, 330)  # a forward that did not spin teaches nothing
        assert lib.cs_lean_spin_ns(1) == spin
    finally:
        lib.cs_lean_spin_reset()
        lib.cs_lean_row_split(row_split)


def test_a_forward_after_an_idle_spell_spins_longer_and_teaches_the_policy_nothing(
    model_file: Path, monkeypatch
) -> None:
    """A forward that starts long after the last one ended (its partner threads asleep,
    their cores idle) waits at its barriers while they come back, on an idle machine too:
    it spins longer (2 ms), and what it saw does not turn spinning off for the forwards
    after it (keystrokes ~150 ms apart tripped the policy at nearly every completion). With
    the idle rule off, the same waits trip it. A real forward after a pause is cold; one
    right after another is not."""
    import time

    lib = quant_gemm.library()
    if lib is None:
        pytest.skip("no quantized kernel")
    monkeypatch.delenv("CODESPEC_SPIN_US", raising=False)
    cold = ctypes.c_int(0)
    lib.cs_lean_spin_reset()
    lib.cs_lean_spin_cold_us(50_000.0)
    try:
        lib.cs_lean_spin_end(1, 0, 0, 0, 0)  # a forward just ended
        spin = lib.cs_lean_spin_begin(1, ctypes.byref(cold))
        assert cold.value == 0 and 0 < spin < 2_000_000
        lib.cs_lean_spin_end(1, 0, spin, 330, 200)  # most waits slept: spinning off
        assert lib.cs_lean_spin_ns(1) == 0
        lib.cs_lean_spin_reset()
        time.sleep(0.12)
        assert lib.cs_lean_spin_begin(1, ctypes.byref(cold)) == 2_000_000 and cold.value == 1
        lib.cs_lean_spin_end(1, 1, 2_000_000, 330, 200)
        assert lib.cs_lean_spin_ns(1) == spin  # still spins
        lib.cs_lean_spin_cold_us(0.0)  # the rule off: the same idle forward trips it
        time.sleep(0.12)
        assert lib.cs_lean_spin_begin(1, ctypes.byref(cold)) == spin and cold.value == 0
        lib.cs_lean_spin_end(1, 0, spin, 330, 200)
        assert lib.cs_lean_spin_ns(1) == 0
        # the one-region forward goes through it
        lib.cs_lean_spin_reset()
        lib.cs_lean_spin_cold_us(50_000.0)
        runner = LeanRunner.from_gguf(model_file, max_length=96, int8=True)
        ids = _ids(4, 3, runner.vocab_size)
        torch.set_num_threads(2)
        runner.forward(ids)
        colds = lib.cs_lean_spin_colds()
        runner.forward(ids)  # right after the last: warm
        assert lib.cs_lean_spin_colds() == colds
        time.sleep(0.12)
        runner.forward(ids)
        assert lib.cs_lean_spin_colds() == colds + 1
    finally:
        torch.set_num_threads(1)
        lib.cs_lean_spin_cold_us(-1.0)
        lib.cs_lean_spin_reset()


def _walk_end(logits: torch.Tensor, ids: list[int], parents: list[int] | None) -> int:
    """The row where greedy verification (speculators.verify.verify_greedy, what the engine
    runs) stops over [root] + draft: row 0 the root, ``parents`` per row (None: a chain)."""
    nodes = None if parents is None else [p - 1 for p in parents[1:]]  # rows -> draft nodes
    accepted, _ = verify_greedy(Draft(ids[1:], nodes), logits)
    return accepted[-1] + 1 if accepted else 0


@pytest.mark.parametrize("regions", ["one", "per-product"])
@pytest.mark.parametrize("int8", [True, False])
def test_a_greedy_draft_stops_the_lm_head_where_verification_ends(
    model_file: Path, regions: str, int8: bool, monkeypatch
) -> None:
    """greedy: the stack computes logits 4 rows first, then the rest, and stops after the
    chunk holding the row where greedy verification's walk ends (a chain's first break, a
    tree's accepted path's end); the rows it gives equal the full forward's bit for bit,
    the cache is the same (one-region and per-product forwards, int8 and exact products),
    and greedy verification of the rows given accepts what it accepts with every row."""
    monkeypatch.setenv("CODESPEC_LEAN_REGIONS", regions)
    runner = LeanRunner.from_gguf(model_file, max_length=128, int8=int8)
    v = runner.vocab_size
    prompt = _ids(20, 21, v)
    runner.forward(prompt[:-1], last_only=True)  # the last prompt token is the root
    # the model's own greedy continuation (no break), then chains broken at rows 0, 2, 5
    g = [prompt[-1]]
    for _ in range(9):
        out = runner.forward([g[-1]])
        g.append(int(out.logits[-1].argmax()))
    runner.truncate(19)
    wrong = [(t + 1) % v for t in g]
    drafts: list[tuple[list[int], list[int] | None]] = [(g, None)]
    for at in (0, 2, 5):
        broken = list(g)
        broken[at + 1] = wrong[at + 1]
        drafts.append((broken, None))
    # trees (row 0 the root): the right branch first, broken at its second node, beside a
    # wrong one (the walk ends at row 1); a wrong branch first, the right one after it,
    # whole (the walk reaches the last row); both branches wrong (it ends at the root)
    drafts += [
        ([g[0], g[1], wrong[2], g[3], wrong[1], g[2], g[3], g[4]], [-1, 0, 1, 2, 0, 4, 5, 6]),
        ([g[0], wrong[1], g[2], g[3], g[1], g[2], g[3], g[4]], [-1, 0, 1, 2, 0, 4, 5, 6]),
        ([g[0], wrong[1], g[2], (g[1] + 2) % v, g[2], g[3], g[4], g[5]],
         [-1, 0, 1, 0, 3, 4, 5, 6]),
    ]  # fmt: skip
    seen = set()
    for ids, par in drafts:
        full = runner.forward(ids, parents=par)
        kv_full = runner.kv.clone()
        runner.truncate(19)
        got = runner.forward(ids, parents=par, greedy=True)
        assert torch.equal(runner.kv, kv_full)
        runner.truncate(19)
        end = _walk_end(full.logits, ids, par)
        want = len(ids) if end >= HEAD_FIRST_ROWS else HEAD_FIRST_ROWS  # the stack's STOP_ROWS
        assert got.logits.shape == (want, v), (end, got.logits.shape)
        assert torch.equal(got.logits, full.logits[:want])
        assert _walk_end(got.logits, ids, par) == end
        seen.add((par is None, want))
    assert seen == {(True, 4), (True, 10), (False, 4), (False, 8)}  # stops and whole drafts
    one = runner.forward(g[:1], greedy=True)  # a one-token forward is never cut
    assert one.logits.shape == (1, v)


@pytest.mark.parametrize("regions", ["one", "per-product"])
def test_the_stack_names_each_rows_argmax(model_file: Path, regions: str, monkeypatch) -> None:
    """ForwardOut.best: each logit row's argmax as torch takes it, whichever thread computed
    which columns of the LM head (one thread or two, thread 0 holding none, some or all of
    them), with the head stopped early or not, a chain, a tree or one token."""
    monkeypatch.setenv("CODESPEC_LEAN_REGIONS", regions)
    lib = quant_gemm.library()
    assert lib is not None
    runner = LeanRunner.from_gguf(model_file, max_length=128, int8=True)
    v = runner.vocab_size
    prompt = _ids(20, 23, v)
    adapt, split = lib.cs_lean_split_adapt(0), lib.cs_lean_split(0.5)
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for f in (0.0, 0.3, 1.0):
                lib.cs_lean_split(f)
                for ids, par, greedy in [
                    (prompt, None, False),
                    (prompt[:9], None, True),
                    (prompt[:8], [-1, 0, 1, 2, 0, 4, 5, 6], True),
                    (prompt[:1], None, False),
                ]:
                    runner.reset()
                    out = runner.forward(ids, parents=par, greedy=greedy)
                    assert out.best == out.logits.argmax(-1).tolist(), (threads, f, par)
    finally:
        torch.set_num_threads(1)
        lib.cs_lean_split_adapt(adapt)
        lib.cs_lean_split(split)


def test_taps_and_last_only(model_file: Path) -> None:
    """Taps 0 .. L (tap L before the final norm) and a last-row-only prefill, as the torch
    runner on the same weights gives them."""
    lean = LeanRunner.from_gguf(model_file, max_length=64)
    ids = _ids(12, 13, lean.vocab_size)
    full = lean.forward(ids, taps=(0, 1, lean.num_layers))
    assert full.hidden is not None and full.hidden.shape == (12, 3, lean.hidden_size)
    x0 = quant_gemm.QuantMatrix.rows(lean._embed_q, ids)
    assert torch.equal(full.hidden[:, 0], x0)
    normed = torch.nn.functional.rms_norm(
        full.hidden[:, 2], (lean.hidden_size,), lean.norm, lean.eps
    )
    torch.testing.assert_close(lean.project(normed), full.logits, atol=1e-4, rtol=1e-4)
    lean.reset()
    assert torch.equal(lean.forward(ids, last_only=True).logits, full.logits[-1:])


def test_header_parser_agrees_with_gguf(model_file: Path) -> None:
    """Every tensor's name, shape, type and bytes as gguf's reader sees them."""
    mine = gguf_weights.read(model_file)
    reader = gguf.GGUFReader(str(model_file))
    assert len(mine.tensors) == len(reader.tensors)
    for t in reader.tensors:
        m = mine.tensors[t.name]
        assert list(m.shape) == [int(s) for s in t.shape]
        assert m.type_id == int(t.tensor_type)
        assert np.array_equal(mine.raw(t.name), np.asarray(t.data).view(np.uint8).reshape(-1))
    cfg = gguf_weights.config_from_meta(mine)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (SHAPE["hidden"], SHAPE["layers"])
    assert cfg.tie_word_embeddings == ("output.weight" not in mine.tensors)


def test_model_folder_loads_from_the_blocks(tmp_path: Path) -> None:
    """A folder the model cache imported from a GGUF runs from the GGUF's blocks (its
    config read as JSON); a GGUF of F16 matrices is left to the folder's safetensors."""
    from codespec.daemon.engine import models

    path = _write(tmp_path / "src" / "q.gguf", "Q8_0")
    folder = models.import_gguf(path, tmp_path / "cache")
    got = from_model_folder(folder, max_length=64)
    assert got is not None
    runner, config = got
    assert runner.gguf and config.model_type == "llama"
    assert runner.int8 == (gguf_products() == "int8")  # int8 where the CPU has the path
    ids = _ids(9, 14, runner.vocab_size)
    direct = LeanRunner.from_gguf(path, max_length=64, int8=runner.int8)
    assert torch.equal(runner.forward(ids).logits, direct.forward(ids).logits)
    half = _write(tmp_path / "half" / "h.gguf", "F16")
    g = gguf_weights.read(half)
    why = gguf_weights.unsupported(g, gguf_weights.config_from_meta(g))
    assert why is not None and "F16" in why
    assert from_model_folder(models.import_gguf(half, tmp_path / "cache"), 64) is None
    assert from_model_folder(tmp_path / "src", 64) is None  # no manifest


def test_the_folder_weights_can_be_asked_for(tmp_path: Path, monkeypatch) -> None:
    """``CODESPEC_GGUF_PRODUCTS=fp16``: the folder's 16-bit weights as panels instead of the
    GGUF's blocks (the caller loads the folder); ``int8``: the blocks with int8 products;
    ``exact``: the blocks with the exact products."""
    from codespec.daemon.engine import models

    folder = models.import_gguf(_write(tmp_path / "src" / "q.gguf", "Q8_0"), tmp_path / "c")
    monkeypatch.setenv("CODESPEC_GGUF_PRODUCTS", "fp16")
    assert from_model_folder(folder, 64) is None
    monkeypatch.setenv("CODESPEC_GGUF_PRODUCTS", "int8")
    got = from_model_folder(folder, 64)
    assert got is not None and got[0].gguf and got[0].int8
    monkeypatch.setenv("CODESPEC_GGUF_PRODUCTS", "exact")
    got = from_model_folder(folder, 64)
    assert got is not None and got[0].gguf and not got[0].int8


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_tokenizer_answers_as_autotokenizer(tmp_path: Path, arch: str) -> None:
    """The daemon's tokenizer without transformers: vocabulary, specials, encode, decode
    and the chat template render as AutoTokenizer's do (a tokenizer the model cache wrote;
    a qwen2 folder names transformers 5's ``Qwen2Tokenizer``)."""
    from transformers import AutoTokenizer

    from codespec.daemon.engine import models, tokenizer

    path = _write(tmp_path / "src" / "q.gguf", "Q8_0", arch)
    folder = models.import_gguf(path, tmp_path / "cache")
    assert tokenizer.fast_enough(folder)
    fast, slow = tokenizer.load(folder), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(fast, tokenizer.FastTokenizer)
    assert fast.get_vocab() == slow.get_vocab() and len(fast) == len(slow)
    assert fast.eos_token_id == slow.eos_token_id
    assert fast.all_special_ids == sorted(slow.all_special_ids)
    assert fast.convert_tokens_to_ids("<file_sep>") == slow.convert_tokens_to_ids("<file_sep>")
    text = "def f(x):\n    return 'é' # 中文<|im_end|>\r\n\t  x"
    ids = slow(text, add_special_tokens=False).input_ids
    assert fast.backend_tokenizer.encode(text, add_special_tokens=False).ids == ids
    assert fast.decode(ids) == slow.decode(ids, skip_special_tokens=False)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a\n b"}]
    for gen in (True, False):
        a = fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        b = slow.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert a == b


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_a_kv_cache_costs_the_memory_its_tokens_fill():
    """The stack's cache is zeroed by the allocator, so an 8,192-token cache (~190 MB for
    the default model's shape) costs next to nothing until written, and writing its first
    tokens costs about their share (what lets the daemon keep several: limits.kv_slots)."""
    from codespec.daemon.engine import qstack

    before = _rss_mb()
    kv = qstack.cache(30, 3, 64, 8192)
    assert kv.dtype == torch.float16 and kv.shape[0] == 30
    assert kv.numel() * 2 > 180e6
    assert _rss_mb() - before < 20  # not committed
    per_layer = kv.shape[1]
    kv[:, : per_layer // 64] = 1.0  # 1/64 of each layer: ~3 MB
    assert _rss_mb() - before < 20
    assert kv[:, : per_layer // 64].eq(1.0).all()
    assert not kv[:, per_layer // 64 : per_layer // 32].any()  # the rest reads as zeros
    assert _rss_mb() - before < 20


@pytest.mark.parametrize("path", ["panels", "rows", "one thread", "per product", "exact"])
def test_an_interrupted_forward_leaves_the_cache_as_it_was(
    model_file: Path, path: str, monkeypatch
) -> None:
    """A warm-up's forward (``forward_unless_interrupted``) whose interrupt flag is set
    stops between layers on every path of the stack (one region by panels or by rows, one
    thread, a region per product, the exact products): None, the length as it was, and
    after it the same forward and the steps after give the logits of a runner never
    interrupted, bit for bit (what it wrote past the cache is never read). Unset, it is a
    ``last_only`` forward."""
    lib = quant_gemm.library()
    assert lib is not None
    if path == "per product":
        monkeypatch.setenv("CODESPEC_LEAN_REGIONS", "per-product")
    int8 = path != "exact"
    ref = LeanRunner.from_gguf(model_file, max_length=96, int8=int8)
    runner = LeanRunner.from_gguf(model_file, max_length=96, int8=int8)
    v = ref.vocab_size
    head, chunk, after = _ids(20, 21, v), _ids(16, 22, v), _ids(3, 23, v)
    want = [ref.forward(head).logits, ref.forward(chunk, last_only=True).logits]
    want.append(ref.forward(after).logits)
    rows_from = lib.cs_lean_row_split(2 if path == "rows" else 0)
    torch.set_num_threads(1 if path == "one thread" else 2)
    try:
        assert runner.interrupt is not None
        got = [runner.forward(head).logits]
        runner.interrupt.set()
        for _ in range(2):
            assert runner.forward_unless_interrupted(chunk) is None
            assert runner.length == len(head)
        runner.interrupt.clear()
        out = runner.forward_unless_interrupted(chunk)
        assert out is not None and runner.length == len(head) + len(chunk)
        got += [out.logits, runner.forward(after).logits]
    finally:
        torch.set_num_threads(1)
        lib.cs_lean_row_split(rows_from)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

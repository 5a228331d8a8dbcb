"""The CPU product kernel (``codespec.daemon.engine.cpu_gemm``) against torch.

Checks: it builds wherever it should (an x86-64 CPU with AVX2 and FMA and a C++
compiler; a build failure must fail here, not fall back silently), its products
equal torch's within fp32 rounding for every row count, bias and residual, its
rows do not depend on the other rows of the call or on threads (what makes a
verify forward equal decode steps bit for bit), and the runner falls back to
torch when the kernel is switched off.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from codespec import native
from codespec.daemon.engine import cpu_gemm

pytestmark = pytest.mark.usefixtures("one_thread")


def _should_build() -> bool:
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and {"avx2", "fma"} <= cpu_gemm.cpu_flags()
        and native.compiler() is not None
        and os.environ.get("CODESPEC_CPU_KERNELS", "1") != "0"
    )


needs_kernel = pytest.mark.skipif(
    cpu_gemm.library() is None, reason=f"kernel unavailable: {cpu_gemm.unavailable_reason()}"
)


def test_builds_where_it_should() -> None:
    if not _should_build():
        pytest.skip("not an x86-64 AVX2 machine with a C++ compiler")
    assert cpu_gemm.library() is not None, cpu_gemm.unavailable_reason()
    assert cpu_gemm.library().cs_gemm_version() == 7


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("k,n", [(48, 80), (37, 16), (384, 640)])
def test_equals_torch(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(k, n, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    res = torch.randn(m, n, generator=g)
    p = cpu_gemm.pack(w)
    assert p.shape == (n // 16, k, 16)
    assert torch.equal(cpu_gemm.unpack(p), w)
    tol = dict(atol=1e-4 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(cpu_gemm.mm(x, p), x @ w, **tol)
    torch.testing.assert_close(cpu_gemm.mm(x, p, bias), x @ w + bias, **tol)
    torch.testing.assert_close(cpu_gemm.mm(x, p, bias, res), x @ w + bias + res, **tol)
    torch.testing.assert_close(cpu_gemm.mm(x, p, None, res), x @ w + res, **tol)


@needs_kernel
def test_rows_do_not_depend_on_the_batch_or_threads() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 1024, generator=g)
    x = torch.randn(37, 384, generator=g)
    res = torch.randn(37, 1024, generator=g)
    p = cpu_gemm.pack(w)
    full = cpu_gemm.mm(x, p, None, res, threads=1)
    for threads in (2, 3):
        assert torch.equal(cpu_gemm.mm(x, p, None, res, threads=threads), full)
    for i in range(37):
        assert torch.equal(cpu_gemm.mm(x[i : i + 1], p, None, res[i : i + 1]), full[i : i + 1])
    # a strided view of x (a slice of a wider tensor) reads the same rows
    wide = torch.zeros(37, 500)
    wide[:, 50:434] = x
    assert torch.equal(cpu_gemm.mm(wide[:, 50:434], p, None, res, threads=1), full)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
def test_16_bit_panels_equal_fp32_panels_of_the_same_weights(m: int, dtype) -> None:
    """fp16 / bf16 panels read half the bytes and give, bit for bit, the products of fp32
    panels holding the same (16-bit-representable) weights: threads, bias and residual
    included."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(384, 640, generator=g).to(dtype).float()
    x = torch.randn(m, 384, generator=g)
    bias = torch.randn(640, generator=g)
    res = torch.randn(m, 640, generator=g)
    full, narrow = cpu_gemm.pack(w), cpu_gemm.pack(w, dtype)
    assert narrow.dtype == dtype and narrow.shape == full.shape
    assert narrow.element_size() * 2 == full.element_size()
    for threads in (1, 2):
        assert torch.equal(
            cpu_gemm.mm(x, narrow, bias, res, threads=threads),
            cpu_gemm.mm(x, full, bias, res, threads=threads),
        )
    # maybe_pack takes 16-bit panels only when nothing is lost (fp16 holds most bf16
    # values of this size too, and is tried first)
    assert cpu_gemm.maybe_pack(w, True, half=True).dtype == cpu_gemm.narrow_dtype(w)
    assert cpu_gemm.narrow_dtype(w) != torch.float32
    assert cpu_gemm.maybe_pack(w, False, half=True) is w


def test_narrow_dtype_keeps_every_value() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=g)
    assert cpu_gemm.narrow_dtype(w.half().float()) == torch.float16
    big = w.bfloat16().float() * 2.0**20  # beyond fp16's range, still bf16
    assert cpu_gemm.narrow_dtype(big) == torch.bfloat16
    assert cpu_gemm.narrow_dtype(w + 1e-4) == torch.float32  # neither holds it
    assert cpu_gemm.maybe_pack(w + 1e-4, True, half=True).dtype == torch.float32


@needs_kernel
def test_bad_shapes_are_refused() -> None:
    p = cpu_gemm.pack(torch.randn(8, 32))
    with pytest.raises(ValueError):
        cpu_gemm.mm(torch.randn(2, 9), p)
    with pytest.raises(ValueError):
        cpu_gemm.mm(torch.randn(2, 8), p, torch.randn(16))
    with pytest.raises(ValueError):
        cpu_gemm.mm(torch.randn(2, 8), p, None, torch.randn(3, 32))
    with pytest.raises(ValueError):
        cpu_gemm.pack(torch.randn(8, 24))  # out not a multiple of 16
    assert cpu_gemm.mm(torch.randn(0, 8), p).shape == (0, 32)


def test_switched_off_by_the_environment(tmp_path) -> None:
    code = (
        "from codespec.daemon.engine import cpu_gemm; "
        "print(cpu_gemm.library() is None, '|', cpu_gemm.unavailable_reason())"
    )
    env = dict(os.environ, CODESPEC_CPU_KERNELS="0", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("True |") and "CODESPEC_CPU_KERNELS=0" in out


@pytest.mark.skipif(not _should_build(), reason="no x86-64 AVX2 machine with a C++ compiler")
def test_a_fresh_cache_builds_once_and_reuses(tmp_path) -> None:
    """A new state dir gets one compiled library; a second process with no compiler on its
    PATH loads that very file (not rebuilt: same name, same mtime)."""
    code = (
        "from codespec.daemon.engine import cpu_gemm; import sys; "
        "sys.exit(0 if cpu_gemm.library() is not None else cpu_gemm.unavailable_reason())"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    env.pop("CODESPEC_KERNEL_DIR", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    built = list((tmp_path / "codespec" / "kernels").glob("gemm-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    env["PATH"] = str(tmp_path / "empty-bin")  # no compiler on PATH now: the cached build serves
    env["CXX"] = ""
    no_compiler = code.replace(
        "import sys; ",
        "import sys; from codespec import native; assert native.compiler() is None; ",
        1,
    )
    subprocess.run([sys.executable, "-c", no_compiler], env=env, check=True)
    assert list((tmp_path / "codespec" / "kernels").glob("gemm-*.so")) == built
    assert built[0].stat().st_mtime_ns == mtime


@needs_kernel
@pytest.mark.parametrize("h", [48, 384, 37])
def test_rms_norm_equals_torch(h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x = torch.randn(5, h, generator=g) * 3
    w = torch.randn(h, generator=g)
    ref = torch.nn.functional.rms_norm(x, (h,), w, 1e-6)
    torch.testing.assert_close(cpu_gemm.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)
    # rows are independent of the batch, as the products'
    one = torch.cat([cpu_gemm.rms_norm(x[i : i + 1], w, 1e-6) for i in range(5)])
    assert torch.equal(one, cpu_gemm.rms_norm(x, w, 1e-6))


@needs_kernel
@pytest.mark.parametrize("past,t", [(0, 1), (37, 1), (300, 1), (70, 3), (129, 5)])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_equals_sdpa(past: int, t: int, tree: bool) -> None:
    """Grouped-query attention over a cache, chain or tree mask, against torch's SDPA."""
    g = torch.Generator().manual_seed(past * 10 + t)
    nkv, groups, d, s_max = 2, 3, 64, 512
    kv = torch.randn(2, nkv, s_max, d, generator=g)
    q = torch.randn(nkv, t * groups, d, generator=g) * 2
    allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))
    if tree and t > 2:
        allowed[t - 1, 1] = False  # the last token hangs off token 0, not 1
    total = past + t
    full = torch.ones(t, total, dtype=torch.bool)
    full[:, past:] = allowed
    mask = torch.zeros(t, total).masked_fill_(~full, float("-inf"))
    mask = mask[:, None, :].expand(t, groups, total).reshape(t * groups, total)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], kv[0][None, :, :total], kv[1][None, :, :total], attn_mask=mask
    )[0]
    got = cpu_gemm.attention(q, kv[0], kv[1], past, t, allowed if tree else None)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cpu_gemm.attention(q, kv[0][:, : total - 1], kv[1][:, : total - 1], past, t)

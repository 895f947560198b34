"""Packed-document attention backends (flex, varlen, split) against `DocumentCausalAttention`.

On CPU torch runs FlexAttention forward only (no backward), and the varlen kernels not at all:
the CPU tests cover flex's forward, split (forward and backward), the cumulative lengths and
the factory's errors; the
`gpu`-marked tests compare forward and backward on CUDA.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from meshrl.models.common.attention import (
    DocumentCausalAttention,
    FlexDocumentAttention,
    SplitDocumentAttention,
    VarlenDocumentAttention,
    document_block_mask,
    document_cu_seqlens,
    document_ids_from_positions,
    make_document_attention,
)
from meshrl.models.qwen3 import FLAVORS, Qwen3

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def packed_doc_ids(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    """(1, sum(lengths)) ids 0, 1, ... with document i spanning lengths[i] tokens."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to(device)


def random_qkv(B: int, Hq: int, Hkv: int, T: int, D: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, device=device).to(dtype) for H in (Hq, Hkv, Hkv)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attend_with_grads(attn, q, k, v, upstream):
    """Output and (dq, dk, dv) of sum(attn(q, k, v) * upstream)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attn.attend(0, q, k, v)
    grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
    return out.detach(), grads


# Rows of several documents, one not a multiple of flex's 128-token blocks, a padding tail of
# one-token documents, and (flex only) a row whose documents interleave.
LENGTHS = [37, 100, 5, 60, 1, 90, 1, 1, 5]  # T = 300


def flex_doc_ids() -> torch.Tensor:
    interleaved = torch.arange(300) % 7 // 3  # ids 0 0 0 1 1 1 2 0 0 0 ...
    return torch.cat([packed_doc_ids(LENGTHS), interleaved[None]])  # (2, 300)


# ---------------------------------------------------------------------------------------------
# CPU


def dense_blocks(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """BlockMask (count, indices) -> (B, H, Qb, KVb) bool of the blocks listed."""
    listed = torch.arange(indices.shape[-1]) < num[..., None]  # (B, H, Qb, KVb)
    dense = torch.zeros(indices.shape, dtype=torch.bool)
    return dense.scatter_(-1, indices.long(), listed)


@pytest.mark.parametrize("T, block_size", [(300, 128), (128, 128), (5, 128), (300, 16), (97, 8)])
def test_document_block_mask_equals_create_block_mask(T, block_size, monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask

    import meshrl.models.common.attention as attention

    gen = torch.Generator().manual_seed(T)
    lengths = torch.randint(1, 40, (T,), generator=gen)
    packed = torch.repeat_interleave(torch.arange(T), lengths)[:T]  # contiguous documents
    interleaved = torch.randint(0, 3, (T,), generator=gen)  # ids scattered through the row
    doc_ids = torch.stack([packed, interleaved, torch.zeros(T, dtype=torch.long)])  # (3, T)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    # A small step forces several query bands per call.
    monkeypatch.setattr(attention, "_MASK_ELEMENTS_PER_STEP", 3 * T * block_size)
    ours = document_block_mask(doc_ids, block_size=block_size)
    ref = create_block_mask(mask_mod, 3, None, T, T, device="cpu", BLOCK_SIZE=block_size)
    assert ours.shape == ref.shape and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in ["kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"]:
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(dense_blocks(ours.kv_num_blocks, ours.kv_indices), dense_blocks(ref.kv_num_blocks, ref.kv_indices))
    assert torch.equal(dense_blocks(ours.full_kv_num_blocks, ours.full_kv_indices),
                       dense_blocks(ref.full_kv_num_blocks, ref.full_kv_indices))
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_flex_eager_forward_matches_sdpa_on_cpu():
    doc_ids = flex_doc_ids()
    q, k, v = random_qkv(B=2, Hq=4, Hkv=2, T=300, D=16, dtype=torch.float32, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        ours = FlexDocumentAttention(doc_ids, compile=False).attend(0, q, k, v)
    ref = DocumentCausalAttention(doc_ids).attend(0, q, k, v)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_flex_padded_to_its_bucket_matches_sdpa_on_cpu():
    """The compiled path's layout: rows padded to a `flex_length` bucket (the padding one more
    document), the mask built at that length, the output cut back to the row."""
    from meshrl.models.common.attention import flex_length, pad_doc_ids, run_flex

    doc_ids = flex_doc_ids()
    assert flex_length(300) == 1024 and flex_length(1024) == 1024 and flex_length(1025) == 2048
    padded = pad_doc_ids(doc_ids, flex_length(300))
    assert torch.equal(padded[:, :300], doc_ids) and bool((padded[:, 300:] == doc_ids.amax(1, keepdim=True) + 1).all())
    q, k, v = random_qkv(B=2, Hq=4, Hkv=2, T=300, D=16, dtype=torch.float32, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = run_flex(q, k, v, document_block_mask(padded), compile=False)
    ref = DocumentCausalAttention(doc_ids).attend(0, q, k, v)
    assert ours.shape == q.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_flex_in_model_matches_sdpa_on_cpu():
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 0]])
    tokens = torch.randint(0, args.vocab_size, positions.shape, generator=torch.Generator().manual_seed(0))
    doc_ids = document_ids_from_positions(positions)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = model(tokens, positions, FlexDocumentAttention(doc_ids, compile=False))
        ref = model(tokens, positions, DocumentCausalAttention(doc_ids))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_document_cu_seqlens_by_hand():
    cu_seqlens, max_len = document_cu_seqlens(torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, 3]]))
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 3, 5, 6, 10] and max_len == 4
    cu_seqlens, max_len = document_cu_seqlens(packed_doc_ids(LENGTHS))
    assert cu_seqlens.tolist() == [0, 37, 137, 142, 202, 203, 293, 294, 295, 300] and max_len == 100


def test_document_cu_seqlens_rejects_interleaved_and_batches():
    with pytest.raises(ValueError, match="contiguous"):
        document_cu_seqlens(torch.tensor([[0, 0, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"\(1, T\)"):
        document_cu_seqlens(torch.zeros(2, 4, dtype=torch.long))


def test_varlen_takes_the_document_boundaries_from_a_host_copy():
    doc_ids = packed_doc_ids(LENGTHS)
    given = VarlenDocumentAttention(doc_ids, host_doc_ids=doc_ids.clone())
    assert given._seqlens is not None  # found when built, from the host copy (no device sync)
    cu_seqlens, max_len = given.cu_seqlens(torch.device("cpu"))
    assert cu_seqlens.tolist() == document_cu_seqlens(doc_ids)[0].tolist() and max_len == 100
    with pytest.raises(ValueError, match="host_doc_ids"):
        VarlenDocumentAttention(doc_ids, host_doc_ids=doc_ids[:, :-1])


def test_varlen_rejects_fp32():
    q, k, v = random_qkv(B=1, Hq=4, Hkv=2, T=6, D=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        VarlenDocumentAttention(torch.tensor([[0, 0, 0, 1, 1, 1]])).attend(0, q, k, v)


def test_factory_sdpa_and_errors():
    doc_ids = packed_doc_ids([3, 4])
    assert isinstance(make_document_attention(doc_ids, "sdpa"), DocumentCausalAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_document_attention(doc_ids, "xformers")
    with pytest.raises(ValueError, match="CUDA"):
        make_document_attention(doc_ids, "flex")
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        with pytest.raises(ValueError, match="CUDA"):
            make_document_attention(doc_ids, "varlen")
        with pytest.raises(ValueError, match=r"one packed row"):
            make_document_attention(torch.zeros(2, 7, dtype=torch.long), "varlen")


def test_split_matches_the_dense_mask_on_cpu():
    """One SDPA per document == the (T, T) document mask, forward and backward, with GQA."""
    doc_ids = packed_doc_ids(LENGTHS)
    q, k, v = random_qkv(B=1, Hq=8, Hkv=2, T=300, D=16, dtype=torch.float64, device="cpu")
    upstream = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = attend_with_grads(SplitDocumentAttention(doc_ids), q, k, v, upstream)
    ref_out, ref_grads = attend_with_grads(DocumentCausalAttention(doc_ids), q, k, v, upstream)
    assert rel_err(out, ref_out) < 1e-12
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < 1e-12
    assert SplitDocumentAttention(doc_ids).bounds()[:3] == [(0, 37), (37, 137), (137, 142)]
    assert isinstance(make_document_attention(doc_ids, "split"), SplitDocumentAttention)
    with pytest.raises(ValueError, match="one packed row"):
        SplitDocumentAttention(torch.zeros(2, 7, dtype=torch.long))


def test_split_falls_back_to_the_mask_for_windows_and_sinks():
    doc_ids = packed_doc_ids([20, 30])
    q, k, v = random_qkv(B=1, Hq=4, Hkv=2, T=50, D=16, dtype=torch.float64, device="cpu")
    sinks = torch.randn(4, dtype=torch.float64)
    for kwargs in ({"window": 8}, {"sinks": sinks}):
        out = SplitDocumentAttention(doc_ids).attend(0, q, k, v, **kwargs)
        ref = DocumentCausalAttention(doc_ids).attend(0, q, k, v, **kwargs)
        assert rel_err(out, ref) < 1e-12, kwargs


def test_split_in_model_matches_sdpa_on_cpu():
    """The debug Qwen3 trains the same with split and with the dense mask (logits and grads)."""
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.double()
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    tokens = torch.randint(0, args.vocab_size, positions.shape, generator=torch.Generator().manual_seed(0))
    doc_ids = document_ids_from_positions(positions)

    def run(attn):
        model.zero_grad()
        logits = model(tokens, positions, attn)
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    ref_logits, ref_grads = run(make_document_attention(doc_ids, "sdpa"))
    logits, grads = run(make_document_attention(doc_ids, "split"))
    assert rel_err(logits, ref_logits) < 1e-12
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < 1e-10


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_factory_flash_attn_not_installed():
    with pytest.raises(ValueError, match="flash-attn package"):
        make_document_attention(packed_doc_ids([3, 4]), "flash_attn")


# ---------------------------------------------------------------------------------------------
# CUDA


def check_against_sdpa(attn, doc_ids, dtype, B, fwd_tol, bwd_tol):
    """attn vs DocumentCausalAttention in fp32 on the same (dtype-rounded) inputs, with GQA."""
    q, k, v = random_qkv(B=B, Hq=8, Hkv=2, T=doc_ids.shape[1], D=64, dtype=dtype, device="cuda")
    upstream = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    out, grads = attend_with_grads(attn, q, k, v, upstream)
    ref_out, ref_grads = attend_with_grads(DocumentCausalAttention(doc_ids), q.float(), k.float(), v.float(), upstream)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert rel_err(out, ref_out) < fwd_tol
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype and g.shape == ref.shape, name
        assert rel_err(g, ref) < bwd_tol, (name, rel_err(g, ref))


# fp32 within kernel-order rounding; bf16 within a few of its 2^-8 units (SDPA's own bf16
# result sits at about the same distance from the fp32 reference).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_matches_sdpa_on_cuda(dtype):
    doc_ids = flex_doc_ids().cuda()
    check_against_sdpa(FlexDocumentAttention(doc_ids), doc_ids, dtype, 2, *TOLERANCES[dtype])
    assert isinstance(make_document_attention(doc_ids, "flex"), FlexDocumentAttention)


@pytest.mark.gpu
@needs_cuda
def test_flex_rows_of_several_lengths_on_cuda():
    """Rows of new lengths in one process (as RL's packed rows come): on torch 2.11 the dynamic
    recompile this used to trigger failed in inductor; rows now run in `flex_length` buckets."""
    for T in (300, 700, 1500):
        doc_ids = (torch.arange(T, device="cuda") // 97)[None]
        check_against_sdpa(FlexDocumentAttention(doc_ids), doc_ids, torch.bfloat16, 1, *TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("torch.nn.attention.varlen") is None, reason="torch < 2.10")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_sdpa_on_cuda(dtype):
    doc_ids = packed_doc_ids(LENGTHS, "cuda")
    check_against_sdpa(VarlenDocumentAttention(doc_ids), doc_ids, dtype, 1, *TOLERANCES[dtype])
    check_against_sdpa(VarlenDocumentAttention(doc_ids, host_doc_ids=doc_ids.cpu()), doc_ids, dtype, 1,
                       *TOLERANCES[dtype])
    assert isinstance(make_document_attention(doc_ids, "varlen"), VarlenDocumentAttention)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_backends_in_model_on_cuda(backend):
    if backend == "varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        pytest.skip("torch < 2.10")
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cuda")
    model.init_weights(seed=0)
    model.to(torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()  # (1, 300)
    tokens = torch.randint(0, args.vocab_size, positions.shape, device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    doc_ids = document_ids_from_positions(positions)

    def run(attn):
        model.zero_grad()
        logits = model(tokens, positions, attn)
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach().float(), [p.grad.float() for p in model.parameters()]

    ref_logits, ref_grads = run(make_document_attention(doc_ids, "sdpa"))
    logits, grads = run(make_document_attention(doc_ids, backend))
    assert rel_err(logits, ref_logits) < 1e-2
    for g, ref in zip(grads, ref_grads):
        assert rel_err(g, ref) < 5e-2

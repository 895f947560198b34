"""Paged KV cache: block reference counts, the prefix cache (chained hashes, LRU eviction,
clearing), copy-on-write, and paged attention against plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrl.runtime.engine.kv_cache import (
    BlockManager,
    KVCache,
    PagedAttention,
    block_hashes,
    grouped_sdpa,
    paged_attention_reference,
    paged_decode_attention,
)


def test_allocate_free_and_refcounts():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a, b, c = blocks.allocate(), blocks.allocate(), blocks.allocate()
    assert {a, b, c} == {1, 2, 3} and blocks.num_free == 0  # block 0 is never handed out
    with pytest.raises(RuntimeError, match="out of blocks"):
        blocks.allocate()
    blocks.incref(a)
    blocks.decref(a)
    assert blocks.num_free == 0
    blocks.release([a, b])
    assert blocks.num_free == 2
    blocks.check()
    with pytest.raises(AssertionError, match="freed twice"):
        blocks.decref(a)


def test_prefix_match_is_chained_and_checks_content():
    bs = 2
    blocks = BlockManager(num_blocks=8, block_size=bs)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, bs, 3)
    table = [blocks.allocate() for _ in range(3)]
    for i, block in enumerate(table):
        blocks.register(block, hashes[i], hashes[i - 1] if i else 0, tuple(tokens[i * bs:(i + 1) * bs]))

    same = [1, 2, 3, 4, 9, 9]
    assert blocks.match(block_hashes(same, bs, 3), same) == table[:2]  # the third block differs
    # The same block content after another prefix is another key: no match.
    shifted = [7, 7, 3, 4]
    assert blocks.match(block_hashes(shifted, bs, 2), shifted) == []
    # A forged hash pointing at a cached block with other content is refused.
    assert blocks.match([hashes[0]], [1, 9]) == []
    assert blocks.ref[table[0]] == 2 and blocks.hits == 2
    blocks.check()


def test_cached_blocks_survive_their_sequence_and_are_evicted_lru():
    bs = 1
    blocks = BlockManager(num_blocks=4, block_size=bs)
    seqs = [[10], [20], [30]]
    for tokens in seqs:
        block = blocks.allocate()
        blocks.register(block, block_hashes(tokens, bs, 1)[0], 0, tuple(tokens))
        blocks.release([block])  # the sequence ends; the block stays cached
    assert blocks.num_free == 3 and len(blocks.cached) == 3
    # A hit takes the block out of the evictable set; a new allocation evicts the oldest other one.
    assert blocks.match(block_hashes([20], bs, 1), [20]) != []
    blocks.allocate()
    assert blocks.match(block_hashes([10], bs, 1), [10]) == []  # [10] was freed first: evicted
    assert blocks.match(block_hashes([30], bs, 1), [30]) != []
    blocks.check()


def test_clear_prefix_cache_keeps_blocks_in_use():
    bs = 1
    blocks = BlockManager(num_blocks=4, block_size=bs)
    used, idle = blocks.allocate(), blocks.allocate()
    blocks.register(used, 11, 0, (1,))
    blocks.register(idle, 22, 0, (2,))
    blocks.release([idle])
    blocks.clear_prefix_cache()
    assert not blocks.cached and blocks.ref[used] == 1 and blocks.num_free == 2
    assert blocks.match([11], [1]) == []
    blocks.check()


def test_copy_on_write_only_when_shared():
    blocks = BlockManager(num_blocks=4, block_size=2)
    block = blocks.allocate()
    mine = [block]
    assert blocks.writable(mine, 0) is None and mine == [block]  # sole owner writes in place
    blocks.incref(block)
    theirs = [block]
    assert blocks.writable(mine, 0) == block  # copy from `block` into the new mine[0]
    assert mine[0] != block and blocks.ref[block] == 1 and blocks.ref[mine[0]] == 1
    assert blocks.writable(theirs, 0) is None
    blocks.check()

    cache = KVCache([0, 1], num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3, dtype=torch.float32, device="cpu")
    cache.data[:, :, :, block] = torch.randn(2, 2, 1, 2, 3)
    cache.copy_blocks([block], [mine[0]])
    assert torch.equal(cache.data[:, :, :, mine[0]], cache.data[:, :, :, block])


def scatter_into_blocks(k: torch.Tensor, block_size: int, num_blocks: int, seed: int):
    """k (B, Hkv, L, D) -> (cache (num_blocks, bs, Hkv, D), tables (B, nb)) with shuffled block ids."""
    B, H, L, D = k.shape
    nb = -(-L // block_size)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))[: B * nb] + 1
    tables = order.view(B, nb)
    cache = torch.randn(num_blocks, block_size, H, D)  # garbage everywhere else
    padded = F.pad(k, (0, 0, 0, nb * block_size - L)).transpose(1, 2)  # (B, nb*bs, H, D)
    cache[tables.reshape(-1)] = padded.reshape(B * nb, block_size, H, D)
    return cache, tables


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (3, 3), (6, 1)])
def test_paged_attention_equals_causal_attention(num_q_heads, num_kv_heads):
    torch.manual_seed(0)
    B, L, D, bs, T = 3, 11, 8, 4, 5  # the last T positions are the new tokens
    q = torch.randn(B, num_q_heads, L, D)
    k, v = torch.randn(B, num_kv_heads, L, D), torch.randn(B, num_kv_heads, L, D)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=num_q_heads != num_kv_heads)
    k_cache, tables = scatter_into_blocks(k, bs, 20, seed=1)
    v_cache, v_tables = scatter_into_blocks(v, bs, 20, seed=1)
    assert torch.equal(v_tables, tables)
    positions = torch.arange(L - T, L).expand(B, T)
    out = paged_attention_reference(q[:, :, -T:], k_cache, v_cache, tables, positions)
    assert torch.allclose(out, ref[:, :, -T:], atol=1e-5)


@pytest.mark.parametrize("T", [1, 3], ids=["matmul-path", "sdpa-path"])
def test_grouped_sdpa_equals_repeated_kv(T):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, T, 4), torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4)
    mask = torch.rand(2, 1, T, 7) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    head_major = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # (Hkv, B, L, D)
    assert torch.allclose(grouped_sdpa(q, *head_major, mask), ref, atol=1e-6)


def test_paged_attention_context_writes_slots_then_attends():
    """A prefill of 6 tokens then one decode token through the context equal full causal attention."""
    torch.manual_seed(2)
    bs, D = 4, 8
    cache = KVCache([0], num_blocks=6, block_size=bs, num_kv_heads=2, head_dim=D, dtype=torch.float32, device="cpu")
    table = [5, 2]
    q, k, v = torch.randn(1, 4, 7, D), torch.randn(1, 2, 7, D), torch.randn(1, 2, 7, D)
    slots = torch.tensor([[table[p // bs] * bs + p % bs for p in range(7)]])
    tables = torch.tensor([table], dtype=torch.int32)
    positions = torch.arange(7)[None]
    prefill = PagedAttention(cache, slots[:, :6], positions[:, :6], tables, fresh=True)
    out6 = prefill.attend(0, q[:, :, :6], k[:, :, :6], v[:, :, :6])
    decode = PagedAttention(cache, slots[:, 6:], positions[:, 6:], tables, torch.tensor([7], dtype=torch.int32))
    out1 = decode.attend(0, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(torch.cat([out6, out1], dim=2), ref, atol=1e-5)
    k_cache, _ = cache.layer(0)
    assert torch.equal(k_cache[2, 2], k[0, :, 6])  # position 6 -> block table[1] = 2, offset 2


@pytest.mark.parametrize("v_dim", [8, 5], ids=["same-dims", "narrow-v"])
def test_k_and_v_of_their_own_dims_are_stored_and_attended(v_dim):
    """MLA-like layers (k head dim 8, v head dim 5): both halves land in their own storage at the
    right slots, decode equals causal attention, copy-on-write copies both."""
    torch.manual_seed(3)
    bs, D = 4, 8
    cache = KVCache([0, 1], num_blocks=6, block_size=bs, num_kv_heads=2, head_dim=D, dtype=torch.float32,
                    device="cpu", v_head_dim=v_dim)
    assert (cache.data is None) == (v_dim != D)
    assert KVCache.bytes_per_block(2, bs, 2, D, torch.float32, v_dim) == 2 * bs * 2 * (D + v_dim) * 4
    table = [5, 2]
    q, k, v = torch.randn(1, 4, 7, D), torch.randn(1, 2, 7, D), torch.randn(1, 2, 7, v_dim)
    slots = torch.tensor([[table[p // bs] * bs + p % bs for p in range(7)]])
    tables = torch.tensor([table], dtype=torch.int32)
    positions = torch.arange(7)[None]
    PagedAttention(cache, slots[:, :6], positions[:, :6], tables, fresh=True).attend(1, q[:, :, :6], k[:, :, :6],
                                                                                      v[:, :, :6])
    decode = PagedAttention(cache, slots[:, 6:], positions[:, 6:], tables, torch.tensor([7], dtype=torch.int32))
    out = decode.attend(1, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == (1, 4, 1, v_dim) and torch.allclose(out, ref[:, :, 6:], atol=1e-5)
    k_cache, v_cache = cache.layer(1)
    assert torch.equal(k_cache[2, 2], k[0, :, 6]) and torch.equal(v_cache[2, 2], v[0, :, 6])
    assert torch.equal(v_cache[5, 1], v[0, :, 1]) and not cache.layer(0)[1].any()  # layer 0 untouched
    cache.copy_blocks([5], [3])
    assert torch.equal(cache.layer(1)[1][3], v_cache[5]) and torch.equal(cache.layer(1)[0][3], k_cache[5])


def test_a_write_of_another_shape_raises_instead_of_corrupting_the_cache():
    """The DeepSeek-V3 bug: a cache sized from k (24 dims) must not accept a v of 16 dims (nor
    the other way round, nor other heads); nothing is written."""
    cache = KVCache([0], num_blocks=4, block_size=2, num_kv_heads=2, head_dim=24, dtype=torch.float32, device="cpu")
    k_cache, v_cache = cache.layer(0)
    slots = torch.tensor([2, 3])
    q, k = torch.randn(1, 4, 2, 24), torch.randn(1, 2, 2, 24)
    attn = PagedAttention(cache, slots[None], torch.arange(2)[None], torch.tensor([[1]], dtype=torch.int32),
                          fresh=True)
    with pytest.raises(ValueError, match="2 heads x 24 dims"):
        attn.attend(0, q, k, torch.randn(1, 2, 2, 16))
    from meshrl.runtime.engine.kv_cache import write_slots

    with pytest.raises(ValueError, match="2 heads x 24 dims"):
        write_slots(v_cache, slots, torch.randn(1, 1, 2, 24))  # one head
    with pytest.raises(ValueError, match="slots"):
        write_slots(v_cache, slots, torch.randn(1, 2, 3, 24))
    assert not v_cache.any() and not k_cache.any()
    with pytest.raises(ValueError, match="layer 3 has no KV cache"):
        cache.layer(3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(16, 8), (6, 2), (4, 4)])
@pytest.mark.parametrize("block_size,splits", [(16, None), (16, 1), (16, 3), (32, 2), (8, 1)])
def test_triton_decode_kernel_equals_reference(dtype, num_q_heads, num_kv_heads, block_size, splits):
    """Tiles of 64 keys cross blocks; split key ranges merge to the same softmax; rows of 1 key."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    B, D, bs, num_blocks, nb = 6, 64, block_size, 80, 300 // block_size
    k = torch.randn(num_blocks, bs, num_kv_heads, D, device="cuda", dtype=dtype)
    v = torch.randn(num_blocks, bs, num_kv_heads, D, device="cuda", dtype=dtype)
    tables = torch.randint(1, num_blocks, (B, nb), device="cuda", dtype=torch.int32)
    context_lens = torch.tensor([1, 16, 17, 100, 130, nb * bs], device="cuda", dtype=torch.int32)
    q = torch.randn(B, num_q_heads, 1, D, device="cuda", dtype=dtype)
    out = paged_decode_attention(q, k, v, tables, context_lens, splits=splits)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), tables.long(), (context_lens - 1).long()[:, None])
    assert (out.float() - ref).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2)


def test_engine_serves_a_model_whose_values_are_narrower_than_its_keys():
    """DeepSeek-V3 (MLA: q/k head dim 16 + 8, v head dim 16) through the generic path: the engine
    sizes k and v separately and its greedy output equals transformers'."""
    transformers = pytest.importorskip("transformers")
    from meshrl.models.generic_hf import GenericArgs, HFCausalLM
    from meshrl.runtime.engine.api import Request, SamplingParams, generate
    from meshrl.runtime.engine.native import NativeEngine

    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8)  # not a degenerate echo
    ours = HFCausalLM(GenericArgs.from_hf_config(cfg.to_dict()))
    ours.load_state_dict({"hf." + k: v for k, v in hf.state_dict().items()})
    engine = NativeEngine(ours, max_num_seqs=2, max_model_len=64, device="cpu", dtype=torch.float32, block_size=4)
    assert engine.kv.data is None and (engine.kv.head_dim, engine.kv.v_head_dim) == (24, 16)
    prompts = [[3, 5, 7, 11, 13, 2, 9], [4, 4, 8]]
    completions = generate(engine, [Request(i, p, SamplingParams(temperature=0.0, max_tokens=10))
                                    for i, p in enumerate(prompts)])
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
        assert completion.token_ids == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-prefill-expanded", "cached-absorbed"])
def test_latent_attention_equals_expanded_mla(fresh):
    """attend_latent over a latent cache (one kv head of [latent, rope key], no values) equals
    attention over the expanded per-head k (nope + rope) and v, for a prefill of new tokens only
    (expanded there) and for queries over a cached prefix (absorbed: q_nope W_uk against the latent)."""
    torch.manual_seed(4)
    B, H, T, Dn, Dr, Dv, R, bs = 2, 3, 7, 6, 4, 5, 8, 4
    q_nope, q_rope = torch.randn(B, H, T, Dn), torch.randn(B, H, T, Dr)
    latent, k_rope = torch.randn(B, T, R), torch.randn(B, 1, T, Dr)
    wkv_b = torch.randn(H * (Dn + Dv), R)
    k_nope, v = (latent @ wkv_b.T).view(B, T, H, Dn + Dv).transpose(1, 2).split([Dn, Dv], -1)
    ref = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1),
                                         torch.cat([k_nope, k_rope.expand(-1, H, -1, -1)], -1), v, is_causal=True)
    cache = KVCache([0], num_blocks=8, block_size=bs, num_kv_heads=1, head_dim=R + Dr, dtype=torch.float32,
                    device="cpu", v_head_dim=0)
    assert cache.latent and cache.data is None
    tables = torch.tensor([[3, 5], [6, 1]], dtype=torch.int32)
    slots = torch.stack([tables[b, torch.arange(T) // bs].long() * bs + torch.arange(T) % bs for b in range(B)])
    positions = torch.arange(T).expand(B, T)
    split = T if fresh else 4  # not fresh: the first 4 tokens are cached first, then 3 attend over them
    first = PagedAttention(cache, slots[:, :split], positions[:, :split], tables, fresh=True)
    out = first.attend_latent(0, q_nope[:, :, :split], q_rope[:, :, :split], latent[:, :split],
                              k_rope[:, :, :split], wkv_b, Dv)
    if not fresh:
        rest = PagedAttention(cache, slots[:, split:], positions[:, split:], tables)
        out = torch.cat([out, rest.attend_latent(0, q_nope[:, :, split:], q_rope[:, :, split:], latent[:, split:],
                                                 k_rope[:, :, split:], wkv_b, Dv)], dim=2)
    assert out.shape == (B, H, T, Dv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    k_cache, _ = cache.layer(0)
    assert torch.equal(k_cache[5, 1, 0], torch.cat([latent[0, 5], k_rope[0, 0, 5]]))  # position 5 of row 0

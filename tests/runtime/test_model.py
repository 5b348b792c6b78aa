"""The tiny Llama: paged attention against dense attention, the paged model against the dense
reference, weight naming and sources, and the null model's token function."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from enginewire.runtime.config import EngineConfig
from enginewire.runtime.executor import NullWorker
from enginewire.runtime.model import (
    TINY_ARCH,
    LlamaArch,
    LlamaModel,
    TinyRandomSource,
    build_attention_metadata,
    dense_forward,
    null_token,
    paged_attention,
    param_shapes,
    register_weight_source,
    resolve_weight_source,
)
from enginewire.runtime.scheduler import DecodeBatch

torch.set_num_threads(1)


def _scatter_into_blocks(seq_lens: list[int], block_size: int, num_blocks: int,
                         rng: random.Random) -> list[list[int]]:
    """A shuffled, non-contiguous block table per sequence, so paging is really exercised."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense(block_size: int) -> None:
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    heads, kv_heads, d = 4, 2, 8
    seq_lens = [1, 5, 17, 33]
    # Each sequence computes its last q_lens tokens this step (decode, chunk, full prefill).
    q_lens = [1, 5, 3, 33]
    num_blocks = 64
    tables = _scatter_into_blocks(seq_lens, block_size, num_blocks, rng)
    cache = torch.zeros(2, num_blocks * block_size, kv_heads, d)
    qs, dense_outs = [], []
    ranges = []
    for n, qn, table in zip(seq_lens, q_lens, tables, strict=True):
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(n)])
        cache[0][slots], cache[1][slots] = k, v
        kk = k.repeat_interleave(heads // kv_heads, dim=1)
        vv = v.repeat_interleave(heads // kv_heads, dim=1)
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        qs.append(q[n - qn:])
        dense_outs.append(ref[n - qn:])
        ranges.append(range(n - qn, n))
    meta = build_attention_metadata(ranges, tables, block_size, "cpu")
    out = paged_attention(torch.cat(qs), cache, meta, block_size)
    torch.testing.assert_close(out, torch.cat(dense_outs), atol=1e-5, rtol=1e-4)


def test_paged_model_logits_match_dense_reference() -> None:
    arch, params = TinyRandomSource(seed=3).load()
    model = LlamaModel(arch, params, "cpu")
    bs, num_blocks = 4, 32
    caches = [torch.zeros(2, num_blocks * bs, arch.num_kv_heads, arch.head_dim)
              for _ in range(arch.num_layers)]
    prompt = [random.Random(0).randrange(arch.vocab_size) for _ in range(23)]
    table = list(range(num_blocks - 1, num_blocks - 1 - 6, -1))  # 6 blocks, descending ids
    # Chunked prefill 10 + 13 tokens, then read logits of the whole sequence chunk by chunk.
    logits = []
    for lo, hi in ((0, 10), (10, 23)):
        meta = build_attention_metadata([range(lo, hi)], [table], bs, "cpu")
        hidden = model.forward(torch.tensor(prompt[lo:hi]), meta, caches, bs)
        logits.append(model.compute_logits(hidden))
    ref = dense_forward(arch, params, prompt)
    torch.testing.assert_close(torch.cat(logits), ref, atol=1e-4, rtol=1e-4)


def test_hf_parameter_names_and_shapes() -> None:
    arch, params = TinyRandomSource(seed=0).load()
    names = set(params)
    for n in range(arch.num_layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            assert f"model.layers.{n}.{part}.weight" in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (
        arch.num_kv_heads * arch.head_dim, arch.hidden_size)
    tied = LlamaArch(tie_word_embeddings=True)
    assert "lm_head.weight" not in param_shapes(tied)


def test_tiny_source_is_a_function_of_the_seed() -> None:
    a = TinyRandomSource(seed=7).load()[1]
    b = TinyRandomSource(seed=7).load()[1]
    c = TinyRandomSource(seed=8).load()[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def test_weight_source_registry() -> None:
    assert isinstance(resolve_weight_source("tiny", 1), TinyRandomSource)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_weight_source("no-such-model", 0)
    small = LlamaArch(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1)
    register_weight_source(".tinyw", lambda model, seed: TinyRandomSource(seed, small, model))
    src = resolve_weight_source("/x/y.tinyw", 5)
    assert src.load()[0] == small and src.name == "/x/y.tinyw"
    # Names and suffixes match whatever their case.
    assert isinstance(resolve_weight_source("TINY", 1), TinyRandomSource)
    assert resolve_weight_source("/x/Y.TINYW", 5).load()[0] == small


def test_builtin_model_names_are_stored_lowercased() -> None:
    assert EngineConfig(model="SmolLM2-135M").model == "smollm2-135m"
    assert EngineConfig(model="NULL") == EngineConfig(model="null")
    assert EngineConfig(model="/models/My.gguf").model == "/models/My.gguf"  # paths kept


@pytest.mark.parametrize(("model", "hint"), [
    ("https://huggingface.co/x/y.bin", "nothing is downloaded"),
    ("HuggingFaceTB/SmolLM2-135M", "Hugging Face repo id"),
    ("{dir}", "checkpoint folders"),
    ("{dir}/model.safetensors", "only GGUF files"),
    ("no-such-model", "known: "),
])
def test_an_unknown_model_says_why_when_it_looks_like_a_checkpoint(
        model: str, hint: str, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    model = model.format(dir=tmp_path)
    with pytest.raises(ValueError, match="unknown model") as err:
        resolve_weight_source(model, 0)
    assert hint in str(err.value) and repr(model) in str(err.value)


def test_null_token_matches_null_worker_and_avoids_eos() -> None:
    class R:
        def __init__(self, seed: int, toks: list[int], computed: int) -> None:
            self.seed, self.all_token_ids, self.num_computed_tokens = seed, toks, computed
            self.num_tokens = len(toks)
            # What a DecodeBatch row also reads.
            self.request_id, self.stop_len, self.eos = f"r{seed}", 1 << 20, -1
            self.stop_ids, self.num_cached_tokens = frozenset(), 0

    w = NullWorker(EngineConfig(model="null"))
    reqs = [R(5, [1] * 10, 9), R(6, [1] * 4, 0), R(7, [1] * 30, 0)]
    # The third computes only part of its prompt, so it samples nothing.
    assert w.execute_model(reqs, [1, 4, 8]) == [null_token(5, 10), null_token(6, 4), -1]  # type: ignore[arg-type]
    # Column-wise: each row decodes its token at index ntok; a seed past int64 still matches.
    big = 1 << 70
    rows = [R(5, [1] * 10, 9), R(big, [1] * 40, 39), R(0, [1] * 3, 2)]
    batch = DecodeBatch(rows)  # type: ignore[arg-type]
    assert w.execute_decode(batch).tolist() == [null_token(5, 10), null_token(big, 40),
                                                 null_token(0, 3)]
    toks = {null_token(s, i) for s in range(20) for i in range(300)}
    assert TINY_ARCH.eos_token_id not in toks
    assert min(toks) >= 3 and max(toks) < TINY_ARCH.vocab_size

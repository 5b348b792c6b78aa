"""Broken and hostile GGUF files: each is refused with a ValueError naming the file and the
problem, quickly and before allocating anything in proportion to what the file declares
(the gguf package's reader trusts declared counts and lengths)."""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from enginewire.runtime.gguf_loader import GGUFWeightSource  # noqa: E402


def write(path: Path, *, heads: int = 2, kv: int = 1, layers: int = 1, vocab_key: int | None = None,
          ctx: int = 64, shapes: dict[str, tuple[int, ...]] | None = None,
          alignment: int | None = None) -> Path:
    hidden, ff, vocab = 8, 16, 32
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", kv)
    w.add_uint32("llama.feed_forward_length", ff)
    w.add_uint32("llama.block_count", layers)
    w.add_uint64("llama.context_length", ctx)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if vocab_key is not None:
        w.add_uint32("llama.vocab_size", vocab_key)
    hd = hidden // 2
    sh = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
          "blk.0.attn_q.weight": (2 * hd, hidden), "blk.0.attn_k.weight": (hd, hidden),
          "blk.0.attn_v.weight": (hd, hidden), "blk.0.attn_output.weight": (hidden, 2 * hd),
          "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
          "blk.0.ffn_down.weight": (hidden, ff), "blk.0.attn_norm.weight": (hidden,),
          "blk.0.ffn_norm.weight": (hidden,)}
    sh.update(shapes or {})
    rng = np.random.default_rng(0)
    for name, shape in sh.items():
        w.add_tensor(name, rng.random(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mutate(src: Path, dst: Path, edit: Callable[[bytes], bytes]) -> Path:
    dst.write_bytes(edit(src.read_bytes()))
    return dst


def refused(path: Path, match: str) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=match) as err:
            GGUFWeightSource(path).load()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.name in str(err.value), err.value
    assert time.perf_counter() - t0 < 10 and peak < 64 << 20, (peak, err.value)


def test_a_valid_tiny_file_loads(tmp_path: Path) -> None:
    arch, state = GGUFWeightSource(write(tmp_path / "ok.gguf")).load()
    assert arch.num_layers == 1 and state["model.embed_tokens.weight"].shape == (32, 8)


def test_declared_counts_and_lengths_past_the_file_are_refused_before_parsing(
        tmp_path: Path) -> None:
    ok = write(tmp_path / "ok.gguf")
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    key = b"x.arr"
    huge_array = header + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 1 << 60)
    (tmp_path / "array.gguf").write_bytes(huge_array + b"\0" * 16)
    refused(tmp_path / "array.gguf", "runs past the end of the file")
    refused(mutate(ok, tmp_path / "tensors.gguf",
                   lambda b: b[:8] + struct.pack("<Q", 1 << 62) + b[16:]), "more than a file")
    refused(mutate(ok, tmp_path / "keys.gguf",
                   lambda b: b[:16] + struct.pack("<Q", 1 << 62) + b[24:]), "more than a file")
    refused(mutate(ok, tmp_path / "keylen.gguf",
                   lambda b: b[:24] + struct.pack("<Q", 1 << 62) + b[32:]), "key #0 runs past")
    refused(mutate(ok, tmp_path / "short.gguf", lambda b: b[:40]), "more than a file")
    refused(mutate(ok, tmp_path / "magic.gguf", lambda b: b"GGUX" + b[4:]), "not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", "empty")


@pytest.mark.parametrize("alignment", [None, 256])
def test_a_truncated_file_is_named_truncated(tmp_path: Path, alignment: int | None) -> None:
    """A partial download: the reader slices the tensor data short and failed on a reshape
    ("cannot reshape array of size 24 into shape (8,)"), which did not say what was wrong."""
    ok = write(tmp_path / "ok.gguf", alignment=alignment)
    GGUFWeightSource(ok).load()  # the data start follows general.alignment: no false alarm
    size = ok.stat().st_size
    last = gguf.GGUFReader(str(ok)).tensors[-1]  # padding to the alignment may follow it
    tail = last.data_offset + last.n_bytes
    refused(mutate(ok, tmp_path / "cut_tail.gguf", lambda b: b[:tail - 1]),
            f"the file is truncated: tensor {last.name} needs bytes up to {tail}, the file has"
            f" {tail - 1}")
    refused(mutate(ok, tmp_path / "cut_half.gguf", lambda b: b[:size // 2]),
            "the file is truncated: tensor .* needs bytes up to")


def test_inconsistent_architecture_metadata_is_refused_at_load(tmp_path: Path) -> None:
    refused(write(tmp_path / "heads.gguf", heads=0), "non-positive sizes")
    refused(write(tmp_path / "kv.gguf", kv=0), "non-positive sizes")
    refused(write(tmp_path / "blocks.gguf", layers=1 << 31), "block_count=2147483648")
    refused(write(tmp_path / "ctx.gguf", ctx=1 << 40), "context_length")
    refused(write(tmp_path / "vocab.gguf", vocab_key=1000), "vocab_size=1000 .* 32 rows")


def test_a_tensor_of_the_wrong_shape_is_named_before_the_engine_runs(tmp_path: Path) -> None:
    refused(write(tmp_path / "up.gguf", shapes={"blk.0.ffn_up.weight": (16, 4)}),
            r"blk.0.ffn_up.weight has shape \[16, 4\], the architecture needs \[16, 8\]")
    refused(write(tmp_path / "embd.gguf", shapes={"token_embd.weight": (32, 4)}),
            r"token_embd.weight has shape")

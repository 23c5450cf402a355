"""vLLM's greedy outputs equal our generate() for each family: prompts of different lengths batched together
(decodes and prefills in the same steps), a prompt prefilled in chunks, and requests preempted mid-generation."""

from __future__ import annotations

import random

from conftest import CHUNK, reference
from vllm import SamplingParams

NEW_TOKENS = 12
# Lengths 1 (a first step that is a "decode"), short ones, and one longer than a step (CHUNK): prefilled in chunks.
LENGTHS = (1, 3, 7, 19, 2 * CHUNK + 6)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 64) for _ in range(length)] for length in LENGTHS]


def greedy(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)


def test_batched_greedy_equals_generate(served):
    family, _, model, llm = served
    batch = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    assert got == reference(model, batch, NEW_TOKENS), family


def test_staggered_and_preempted_requests(served):
    """Requests arriving while others run, then every running request preempted (vLLM's own preemption: blocks
    freed, tokens recomputed from the start) and finished: the same tokens as uninterrupted generate() calls.

    The long prompt comes first and takes two whole steps; the others arrive for the step that prefills its last
    chunk, so that step mixes a continuing prefill with new ones (and a one-token prompt, a "decode" with no past)."""
    family, _, model, llm = served
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # the in-process engine core (conftest)
    batch = prompts()
    finished = {}

    def step():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)

    longest = len(batch) - 1
    engine.add_request(str(longest), {"prompt_token_ids": batch[longest]}, greedy())
    step(), step()
    (first,) = scheduler.running  # (the scheduler's request ids are the engine's, not ours)
    assert first.num_computed_tokens == 2 * CHUNK  # still in its chunks
    for i, prompt in enumerate(batch[:longest]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy())
    for _ in range(3):
        step()
    running = list(scheduler.running)
    assert len(running) == len(batch)
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert all(request.num_preemptions == 1 and request.num_computed_tokens == 0 for request in running)
    while engine.has_unfinished_requests():
        step()
    assert [finished[str(i)] for i in range(len(batch))] == reference(model, batch, NEW_TOKENS), family

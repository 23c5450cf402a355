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


def test_preempted_requests_restart_from_zero_states(served):
    """Every running request preempted after a few steps (vLLM's own preemption: blocks freed, tokens recomputed
    from the start), then finished: the same tokens as an uninterrupted generate()."""
    family, _, model, llm = served
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # the in-process engine core (conftest)
    batch = prompts()
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy())
    finished = {}

    def step():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)

    for _ in range(4):  # the long prompt is still in its chunks, the short ones are decoding
        step()
    running = [request.request_id for request in scheduler.running]
    assert running, "nothing running to preempt"
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert all(scheduler.requests[i].num_preemptions == 1 for i in running)
    while engine.has_unfinished_requests():
        step()
    assert [finished[str(i)] for i in range(len(batch))] == reference(model, batch, NEW_TOKENS), family

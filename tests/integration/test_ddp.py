"""Multi-process training: Trainer under torchrun and under accelerate launch, two CPU processes,
DistributedDataParallel over gloo.

The test launches this file as the worker script (``python -m torch.distributed.run --nproc_per_node 2
tests/integration/test_ddp.py OUT``, or ``accelerate launch --multi_gpu --num_processes 2 ...``). Each rank builds
every family with a *different* random initialisation and trains on its own shard of the batch (Trainer's
distributed sampler); DDP broadcasts rank 0's weights and averages the gradients, so both ranks must end with
identical parameters, and the loss must fall.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STEPS = 6
ROWS, LENGTH = 8, 12


def worker(out_dir: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: families.py
    from transformers import Trainer, TrainingArguments

    from families import FAMILIES

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    report = {}
    for name, family in FAMILIES.items():
        torch.manual_seed(100 + rank)  # different on each rank: DDP must broadcast rank 0's weights
        model = family.lm_class(family.config_class(**family.tiny))
        generator = torch.Generator().manual_seed(0)  # the same data on every rank; the sampler shards it
        ids = torch.randint(3, family.tiny["vocab_size"], (ROWS, LENGTH), generator=generator)
        args = TrainingArguments(output_dir=str(out_dir / name), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=2e-2,
                                 lr_scheduler_type="constant", use_cpu=True, ddp_backend="gloo",
                                 # every parameter gets a gradient at every step: DDP needs no unused-parameter search
                                 ddp_find_unused_parameters=False, report_to="none",
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args,
                          train_dataset=[{"input_ids": row, "labels": row} for row in ids])
        seen = []
        model.model.embeddings.register_forward_hook(lambda _m, inputs, _o, seen=seen: seen.append(inputs[0].clone()))
        trainer.train()
        model.eval()
        with torch.no_grad():
            seen_rows = torch.cat(seen).tolist()
            after = model(ids, labels=ids).loss.item()
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, out_dir / f"{name}_rank{rank}.pt")
        report[name] = {"after": after, "seen": seen_rows, "world_size": trainer.args.world_size,
                        "wrapped": type(trainer.model_wrapped).__name__,
                        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
        if rank == 0:  # the loss of rank 0's initial weights (the ones DDP broadcast), for the test
            torch.manual_seed(100)
            initial = family.lm_class(family.config_class(**family.tiny)).eval()
            with torch.no_grad():
                report[name]["before"] = initial(ids, labels=ids).loss.item()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"world": world, "families": report}))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# The README's commands. On CPU, accelerate's torchrun launcher is `--multi_gpu` (its own multi-CPU mode needs MPI).
LAUNCHERS = {
    "torchrun": lambda: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    "accelerate": lambda: [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "--main_process_port", str(_free_port())],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_process_trainer_ddp_keeps_ranks_identical(tmp_path, launcher):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.run([*LAUNCHERS[launcher](), __file__, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(report["world"] == 2 for report in reports)
    for name, rank0 in reports[0]["families"].items():
        rank1 = reports[1]["families"][name]
        assert rank0["world_size"] == 2 and rank0["wrapped"] == "DistributedDataParallel"
        assert rank0["backend"] == "gloo"
        # each rank trained on its own shard of the rows
        assert sorted(map(tuple, rank0["seen"])) != sorted(map(tuple, rank1["seen"]))
        first, second = (torch.load(tmp_path / f"{name}_rank{r}.pt") for r in (0, 1))
        assert first.keys() == second.keys()
        for key in first:
            assert torch.equal(first[key], second[key]), f"{name}: {key} differs between ranks"
        assert rank0["after"] == rank1["after"]
        assert rank0["after"] < 0.8 * rank0["before"], (name, rank0["before"], rank0["after"])


def test_sharding_attributes(family):
    """What FSDP / DeepSpeed / device_map look at: the block class to wrap or keep whole (accelerate's FSDP auto-wrap
    reads `_no_split_modules`), and no context parallelism (the sequence must not be split across ranks)."""
    model = family.lm_class(family.config_class(**family.tiny))
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    assert len(blocks) == family.tiny["num_hidden_layers"]
    # the shared block, or the hybrid's subclass of it (matched by class name, so it names its own)
    assert set(model._no_split_modules) == {type(block).__name__ for block in model.model.layers}
    # supports_context_parallel: transformers 5.17 on (no context parallelism before it)
    assert model.supports_gradient_checkpointing and not getattr(model, "supports_context_parallel", False)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    if torch.distributed.is_initialized():  # a clean exit for every rank (see test_fsdp.py's entry point)
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Multi-process training with transformers' Trainer: DDP or FSDP2, sharded checkpoints, resuming, a final
``save_pretrained`` directory. Launch it with torchrun, one process per GPU (README: Multi-process training):

    torchrun --nproc_per_node 2 examples/train_distributed.py --strategy fsdp --output-dir fsdp_run
    torchrun --nproc_per_node 2 examples/train_distributed.py --output-dir fsdp_run --resume --max-steps 300
    torchrun --nproc_per_node 2 examples/train_distributed.py --strategy ddp --output-dir ddp_run

The data is the demo's synthetic task (continue arithmetic progressions mod 32, ``selective_rope.demo``); put your
own dataset in ``dataset()``. ``--init DIR`` starts from a saved or converted model (``selective-rope convert``)
instead of a new tiny one. Without a GPU it runs on CPU processes over gloo (see ``accelerate_fsdp_on_cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import selective_rope  # noqa: F401  (registers our models with the Auto classes)
from selective_rope.demo import continuation_accuracy, demo_config, progressions
from selective_rope.families import FAMILY_NAMES

# FSDP2 through accelerate: every decoder block is one unit, all-gathered before its forward and resharded after (the
# class the model's `_no_split_modules` names, accelerate's default: SelectiveRopeDecoderBlock, or the hybrid's
# SelectiveRopeHybridDecoderBlock), its activations are recomputed in the backward pass, and checkpoints are
# torch.distributed.checkpoint shards.
FSDP_CONFIG = {
    "version": 2,
    "activation_checkpointing": True,  # FSDP's own; not TrainingArguments(activation_checkpointing=True)
    "state_dict_type": "SHARDED_STATE_DICT",
}


def dataset(rows: int, length: int, seed: int) -> list[dict]:
    ids = progressions(rows, length, torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = -100  # the step is unknown until two terms are seen
    return [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]


@contextlib.contextmanager
def accelerate_fsdp_on_cpu():
    """Let accelerate take its FSDP path on CPU processes while the Trainer builds its Accelerator.

    accelerate 1.15 turns an FSDP plugin into FSDP only for accelerator devices (``AcceleratorState`` checks for
    ``MULTI_GPU``, ``MULTI_XPU``, ...); on CPU (``MULTI_CPU``) it drops the plugin without a word and the Trainer
    trains with DDP. FSDP2 itself runs on CPU over gloo and nothing in accelerate's FSDP path needs a GPU, so to try
    this script (and in our tests) we present the CPU processes as ``MULTI_GPU`` for that one decision; accelerate
    then records ``FSDP`` as the distributed type for good, and the device stays the CPU. Not used on GPUs.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    state.distributed_type = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if state.distributed_type == DistributedType.MULTI_GPU:  # no Accelerator with an FSDP plugin was built
            state.distributed_type = DistributedType.MULTI_CPU


# TrainingArguments' name for activation checkpointing: transformers 5.23 renamed `gradient_checkpointing` (kept as a
# deprecated alias until v6), and this package supports transformers from 5.10.
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                 else "gradient_checkpointing")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--family", choices=FAMILY_NAMES, default="gla", help="a new tiny model of this family")
    parser.add_argument("--init", type=Path, help="start from this saved / converted model directory instead")
    parser.add_argument("--output-dir", type=Path, required=True, help="checkpoints and final/ go here")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per process and micro-batch")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (Selective RoPE stays float32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    on_cpu = not torch.cuda.is_available()
    fsdp = args.strategy == "fsdp"
    training_args = TrainingArguments(  # starts torch.distributed (gloo on CPU, nccl on GPUs)
        output_dir=str(args.output_dir), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=10, bf16=args.bf16,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=20, seed=args.seed, report_to="none",
        use_cpu=on_cpu, fsdp=fsdp, fsdp_config=FSDP_CONFIG if fsdp else None,
        **{CHECKPOINTING: not fsdp},  # under FSDP, fsdp_config's activation_checkpointing does it
        ddp_find_unused_parameters=False,  # every parameter gets a gradient at every step
    )
    if fsdp and training_args.world_size == 1:
        parser.error("FSDP shards over several processes: launch with torchrun --nproc_per_node N")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = (AutoModelForCausalLM.from_pretrained(args.init) if args.init
             else AutoModelForCausalLM.from_config(demo_config(args.family)))
    if fsdp:  # before the Trainer shards the rest; in every run of a training (the optimizer groups depend on it)
        model.shard_rotary_in_float32()
    with accelerate_fsdp_on_cpu() if fsdp and on_cpu else contextlib.nullcontext():
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset(4096, 24, args.seed))
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    # The final model as one safetensors state dict that from_pretrained loads: FSDP gathers the shards.
    final = args.output_dir / "final"
    if fsdp:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(final))

    probe = progressions(8, 24, torch.Generator().manual_seed(args.seed + 1))
    trainer.model.eval()
    with torch.no_grad():  # every rank runs the forward: FSDP all-gathers each block's weights
        trained_logits = trainer.model(probe.to(trainer.args.device)).logits.float().cpu()
    if trainer.is_world_process_zero():
        reloaded = AutoModelForCausalLM.from_pretrained(final).eval()
        with torch.no_grad():
            difference = (reloaded(probe).logits - trained_logits).abs().max().item()
        accuracy = continuation_accuracy(reloaded, torch.Generator().manual_seed(args.seed + 2))
        precision = " (which ran with bf16 weights)" if args.bf16 else ""
        print(f"{args.strategy} on {training_args.world_size} processes: saved {final}/; reloaded logits differ from "
              f"the trained model's{precision} by {difference:.1e}; greedy continuation accuracy {accuracy:.1%}")
    if torch.distributed.is_initialized():  # TrainingArguments started it (several processes): leave it cleanly
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

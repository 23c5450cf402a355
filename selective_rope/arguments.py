"""What the ``selective-rope`` commands share: argument types and how a command fails."""

from __future__ import annotations

import argparse


def positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def fail(command: str, message: str) -> SystemExit:
    return SystemExit(f"selective-rope {command}: {message}")


def torch_device(command: str, requested: str | None):
    import torch

    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise fail(command, f"invalid --device {requested!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise fail(command, f"--device {requested}: CUDA is not available on this machine")
    return device

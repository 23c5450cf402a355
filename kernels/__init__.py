"""Kernels behind the models. ``*_torch`` modules are the pure-PyTorch backend (any device, the reference)."""

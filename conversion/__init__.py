"""Retrofitting Selective RoPE onto existing checkpoints (SPEC §7).

So far: the Llama-family mapping onto SelectiveRopeFoX (:mod:`.llama`); the converter command is an open issue.
"""

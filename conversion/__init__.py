"""Retrofitting Selective RoPE onto existing checkpoints (SPEC §7). Not implemented yet: see the open issue."""

"""The recall tasks of the MAD suite (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures"),
generated here from their published definitions, in the layout of :mod:`tasks` (a :class:`tasks.Batch` with
unshifted ``targets`` and shifted ``labels``).

Every task takes ``sample(batch, length, generator, train)``; ``length`` is the sequence length in tokens. As in MAD,
the in-context recall tasks train on next-token prediction over the whole sequence (``train=True``) and are scored
only where a value can be recalled (``train=False``); the other tasks train on the positions they are scored on.

``compress``          ``x_1 ... x_{n-1} COMPRESS``: the model reads the sequence, only its last hidden state is kept,
                      and a small MLP decoder (sinusoidal position codes) must rebuild every token from it
                      (:class:`CompressionAutoEncoder`, MAD's auto-encoder setup).
``in_context_recall`` key-value pairs ``k v k v ...``, keys from the lower half of the vocabulary, values from the
                      upper half, one value per key within a sequence; every value whose key was seen before is
                      scored (MAD's multi-query form).
``noisy_recall``      the same with a fraction of the pairs replaced by two tokens of a separate noise vocabulary.
``fuzzy_recall``      keys and values are motifs of 1-3 distinct tokens (at test time every key has the longest
                      size), so the model must find the motif boundaries; sequences are left-padded.
``memorize``          ``k INSERT k INSERT ...`` with a key-to-value map fixed for all sequences (and seeds): the
                      answer at ``INSERT`` is the value of the key before it, which only the weights can hold.
``selective_copy``    ``n`` tokens scattered among blanks, then ``COPY`` and ``n`` blanks, at which the ``n``
                      tokens must be emitted in order.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch
from tasks import IGNORE, Batch, _batch
from torch import nn


def _next_token_targets(input_ids: torch.Tensor, pad: int | None = None) -> torch.Tensor:
    """``targets[:, t] = input_ids[:, t + 1]`` (the language-modelling objective MAD trains recall tasks on)."""
    targets = torch.full_like(input_ids, IGNORE)
    targets[:, :-1] = input_ids[:, 1:]
    if pad is not None:
        targets[input_ids == pad] = IGNORE
        targets[:, :-1][input_ids[:, 1:] == pad] = IGNORE
    return targets


def _python_rng(generator: torch.Generator) -> random.Random:
    """A Python RNG seeded from ``generator``, for the per-sequence loops (the same stream for the same seed)."""
    return random.Random(int(torch.randint(0, 2**62, (1,), generator=generator)))


# --------------------------------------------------------------------------------------------------- compression

class Compress:
    """Tokens ``[0, vocab_size - 1)`` and the compression token ``vocab_size - 1``."""

    name = "compress"

    def __init__(self, vocab_size: int = 16):
        self.vocab_size = vocab_size
        self.COMPRESS = vocab_size - 1

    def sample(self, batch: int, length: int, generator: torch.Generator, train: bool = True) -> Batch:
        tokens = torch.randint(0, self.COMPRESS, (batch, length - 1), generator=generator)
        input_ids = torch.cat([tokens, torch.full((batch, 1), self.COMPRESS)], dim=1)
        return _batch(input_ids, input_ids.clone())  # rebuild every position (the compression token too)

    @staticmethod
    def wrap_model(model) -> nn.Module:
        return CompressionAutoEncoder(model)


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed sine/cosine position codes ``(length, dim)`` (the decoder's only source of position)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    codes = torch.zeros(length, dim)
    codes[:, 0::2] = torch.sin(position * frequency)
    codes[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return codes


class CompressionAutoEncoder(nn.Module):
    """MAD's compression model: the causal LM's backbone encodes, the hidden state at the last position is the code,
    and a non-expanding two-layer MLP decodes token ``t`` from ``code + position(t)``. Returns ``.loss`` (on the
    same shifted ``labels`` as the causal LMs) and ``.logits`` ``(B, T, V)`` (position ``t`` rebuilds token ``t``)."""

    def __init__(self, model, max_length: int = 4096):
        super().__init__()
        dim, vocab = model.config.hidden_size, model.config.vocab_size
        self.encoder = model.model  # the backbone; the LM head is not used
        self.register_buffer("positions", sinusoidal_positions(max_length, dim), persistent=False)
        self.decoder = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                     nn.RMSNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                     nn.RMSNorm(dim), nn.Linear(dim, vocab))

    def forward(self, input_ids, attention_mask=None, labels=None):
        length = input_ids.shape[1]
        hidden = self.encoder(input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        code = hidden[:, -1]  # (B, D): everything the decoder may know
        logits = self.decoder(code[:, None] + self.positions[:length])  # (B, T, V)
        loss = None
        if labels is not None:  # labels[:, t + 1] = target of position t, as for the causal LMs
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                               ignore_index=IGNORE)
        return SimpleNamespace(loss=loss, logits=logits)


# ---------------------------------------------------------------------------------------------- in-context recall

class InContextRecall:
    """Keys ``[0, m/2)``, values ``[m/2, m)`` with ``m = vocab_size - noise_vocab_size``; noise tokens after them."""

    name = "in_context_recall"

    def __init__(self, vocab_size: int = 16, noise_vocab_size: int = 0, frac_noise: float = 0.0):
        if not 0 <= frac_noise < 1:
            raise ValueError(f"frac_noise must be in [0, 1), got {frac_noise}")
        if frac_noise > 0 and noise_vocab_size <= 0:
            raise ValueError("frac_noise > 0 needs noise_vocab_size > 0")
        self.vocab_size, self.frac_noise = vocab_size, frac_noise
        content = vocab_size - noise_vocab_size
        self.keys, self.noise_start = content // 2, content
        self.values = content - self.keys

    def sample(self, batch: int, length: int, generator: torch.Generator, train: bool = True) -> Batch:
        if length % 2 or length < 4:
            raise ValueError(f"{self.name} needs an even length >= 4, got {length}")
        pairs = length // 2
        keys = torch.randint(0, self.keys, (batch, pairs), generator=generator)
        table = self.keys + torch.randint(0, self.values, (batch, self.keys), generator=generator)  # per sequence
        noise = torch.rand(batch, pairs, generator=generator) < self.frac_noise
        noise[torch.arange(batch), torch.randint(0, pairs - 1, (batch,), generator=generator)] = False
        # the last pair probes a key presented earlier (a random non-noise earlier pair)
        weights = (~noise[:, :-1]).float()
        probe = torch.multinomial(weights, 1, generator=generator).squeeze(1)
        keys[:, -1] = keys[torch.arange(batch), probe]
        noise[:, -1] = False
        values = table.gather(1, keys)
        noise_tokens = self.noise_start + torch.randint(0, max(self.vocab_size - self.noise_start, 1),
                                                        (batch, pairs, 2), generator=generator)
        pair_tokens = torch.where(noise[..., None], noise_tokens, torch.stack([keys, values], dim=2))
        input_ids = pair_tokens.flatten(1)  # (B, 2 * pairs)
        if train:
            return _batch(input_ids, _next_token_targets(input_ids))
        seen = torch.zeros(batch, self.keys, dtype=torch.bool)
        targets = torch.full_like(input_ids, IGNORE)
        rows = torch.arange(batch)
        for i in range(pairs):  # a value is recallable once its key was presented in an earlier (non-noise) pair
            recall = seen[rows, keys[:, i]] & ~noise[:, i]
            targets[recall, 2 * i + 1] = values[recall, i]
            seen[rows[~noise[:, i]], keys[~noise[:, i], i]] = True
        # the value at 2i + 1 is predicted from the logits at the key (2i)
        return _batch(input_ids, _predicted_from_previous(targets))


def _predicted_from_previous(targets: torch.Tensor) -> torch.Tensor:
    """Move each scored token to the position before it: the logits there predict it (next-token layout)."""
    moved = torch.full_like(targets, IGNORE)
    moved[:, :-1] = targets[:, 1:]
    return moved


class NoisyRecall(InContextRecall):
    name = "noisy_recall"

    def __init__(self, vocab_size: int = 32, noise_vocab_size: int = 16, frac_noise: float = 0.2):
        super().__init__(vocab_size, noise_vocab_size, frac_noise)


# ---------------------------------------------------------------------------------------------------- fuzzy recall

class FuzzyRecall:
    """Keys and values are motifs of distinct tokens (keys ``[0, m/2)``, values ``[m/2, m)``, ``m = vocab - 1``);
    ``vocab_size - 1`` pads on the left."""

    name = "fuzzy_recall"

    def __init__(self, vocab_size: int = 16, key_motif: int = 3, value_motif: int = 3):
        self.vocab_size, self.key_motif, self.value_motif = vocab_size, key_motif, value_motif
        self.PAD = vocab_size - 1
        content = vocab_size - 1
        self.key_vocab = list(range(content // 2))
        self.value_vocab = list(range(content // 2, content))

    def _one(self, length: int, rng: random.Random, train: bool) -> tuple[list[int], list[int]]:
        def key_size():
            return rng.randint(1, self.key_motif) if train else self.key_motif

        def motif(vocab, size):
            return tuple(rng.sample(vocab, size))

        probe_key = motif(self.key_vocab, key_size())
        probe_value = motif(self.value_vocab, rng.randint(1, self.value_motif))
        probe_size = len(probe_key) + len(probe_value)
        limit = length - probe_size - (self.key_motif + self.value_motif)  # room for the final probe
        # MAD draws the probe's first showing anywhere; here in the first half, so it is always shown before the end
        probe_at = rng.randrange(limit // 2)
        table, presented, tokens, targets = {probe_key: probe_value}, set(), [], []
        while len(tokens) < limit:
            key = probe_key if len(tokens) >= probe_at and probe_key not in presented else motif(self.key_vocab,
                                                                                                 key_size())
            value = table.setdefault(key, motif(self.value_vocab, rng.randint(1, self.value_motif)))
            tokens += [*key, *value]
            targets += [IGNORE] * len(key) + (list(value) if key in presented else [IGNORE] * len(value))
            presented.add(key)
        tokens += [*probe_key, *probe_value]
        targets += [IGNORE] * len(probe_key) + list(probe_value)
        pad = length - len(tokens)
        return [self.PAD] * pad + tokens, [IGNORE] * pad + targets

    def sample(self, batch: int, length: int, generator: torch.Generator, train: bool = True) -> Batch:
        if length < 4 * (self.key_motif + self.value_motif):
            raise ValueError(f"{self.name} needs length >= {4 * (self.key_motif + self.value_motif)}, got {length}")
        rng = _python_rng(generator)
        rows = [self._one(length, rng, train) for _ in range(batch)]
        input_ids = torch.tensor([row[0] for row in rows])
        attention_mask = (input_ids != self.PAD).long()
        if train:
            return _batch(input_ids, _next_token_targets(input_ids, pad=self.PAD), attention_mask)
        return _batch(input_ids, _predicted_from_previous(torch.tensor([row[1] for row in rows])), attention_mask)


# ------------------------------------------------------------------------------------------------------- memorize

class Memorize:
    """Keys ``[0, m/2)`` map to values ``[m/2, m)`` (``m = vocab_size - 1``) by one fixed random pairing;
    ``vocab_size - 1`` is the insert token."""

    name = "memorize"

    def __init__(self, vocab_size: int = 256, map_seed: int = 12345):
        self.vocab_size = vocab_size
        self.INSERT = vocab_size - 1
        content = vocab_size - 1
        self.num_keys = content // 2
        fixed = torch.Generator().manual_seed(map_seed)
        values = content // 2 + torch.randperm(content - content // 2, generator=fixed)
        self.table = values[: self.num_keys]  # (num_keys,): fixed for every sequence, seed and run

    def sample(self, batch: int, length: int, generator: torch.Generator, train: bool = True) -> Batch:
        pairs = length // 2
        keys = torch.randint(0, self.num_keys, (batch, pairs), generator=generator)
        input_ids = torch.stack([keys, torch.full_like(keys, self.INSERT)], dim=2).flatten(1)  # (B, 2 * pairs)
        targets = torch.full_like(input_ids, IGNORE)
        targets[:, 1::2] = self.table[keys]  # read at the insert token
        return _batch(input_ids, targets)


# ------------------------------------------------------------------------------------------------- selective copy

class SelectiveCopy:
    """Tokens ``[0, vocab_size - 2)``, then BLANK and COPY."""

    name = "selective_copy"

    def __init__(self, vocab_size: int = 16, tokens_to_copy: int = 16):
        self.vocab_size, self.tokens_to_copy = vocab_size, tokens_to_copy
        self.BLANK, self.COPY = vocab_size - 2, vocab_size - 1

    def sample(self, batch: int, length: int, generator: torch.Generator, train: bool = True) -> Batch:
        n = self.tokens_to_copy
        span = length - n - 1  # the tokens and the blanks among them
        if span <= n:
            raise ValueError(f"{self.name} needs length > 2 * tokens_to_copy + 1 = {2 * n + 1}, got {length}")
        tokens = torch.randint(0, self.BLANK, (batch, n), generator=generator)
        slots = torch.rand(batch, span, generator=generator).argsort(dim=1)[:, :n].sort(dim=1).values  # (B, n)
        input_ids = torch.full((batch, length), self.BLANK)
        input_ids.scatter_(1, slots, tokens)
        input_ids[:, span] = self.COPY
        targets = torch.full_like(input_ids, IGNORE)
        targets[:, span + 1:] = tokens  # emitted at the blanks after COPY, in order
        return _batch(input_ids, targets)


MAD_TASKS = {task.name: task for task in (Compress, FuzzyRecall, InContextRecall, Memorize, NoisyRecall,
                                          SelectiveCopy)}

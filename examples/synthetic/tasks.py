"""Data generators for the synthetic tasks of the Selective RoPE paper, at CPU scale.

Every generator returns a :class:`Batch` laid out for a causal LM trained with the library's own loss
(``model(input_ids, attention_mask=..., labels=...)``): ``labels[:, t]`` is the token the model must predict *after
reading* ``input_ids[:, t - 1]`` (transformers shifts the labels by one inside the loss), ``-100`` where nothing is
scored. ``targets`` is the same information unshifted (``targets[:, t]`` = the answer expected from the logits at
position ``t``, ``-100`` elsewhere), which is what the evaluation reads.

Tasks
-----
``parity`` (state tracking on S2): ``BOS b_1 ... b_n END`` with random bits (fair, or optionally for training a
per-string density of 1s); the answer after ``b_t`` is the running parity ``b_1 xor ... xor b_t`` (per-token
supervision, as in the state-tracking setups the paper follows); the final-token answer is the parity of the whole
string (read at the position of ``b_n``).

``mqar`` (multi-query associative recall, Arora et al. 2024): ``BOS k_1 v_1 ... k_N v_N  q_1 a_1 ... q_M a_M`` with
distinct keys from one half of the vocabulary and values from the other; each query ``q_j`` is one of the keys, and
the answer ``a_j`` (scored after reading ``q_j``) is that key's value. Queries are fed with their answers (teacher
forcing), so a whole batch is scored in one forward.

``a3`` (state tracking on the alternating group A3, the even permutations of 3 elements): ``BOS g_1 ... g_n END``
with uniformly drawn elements; the answer after ``g_t`` is the composition ``g_1 ∘ ... ∘ g_t`` (apply ``g_1`` first),
per-token supervision as in the word problems of Liu et al. (2023) and Grazzi et al. (2025) that the paper follows.
A3 is cyclic of order 3, so an input-dependent rotation by a third of a turn per 3-cycle solves it exactly.

``copy`` (string copying, Jelassi et al. 2024): ``BOS s_1 ... s_n COPY s_1 ... s_n EOS`` (then padding); after
``COPY`` the model must reproduce the string token by token and then emit ``EOS``. Scored with teacher forcing; a
string is copied exactly when every one of its ``n + 1`` answers is right, which is also exactly when greedy decoding
would reproduce it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor       # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 = real token
    labels: torch.Tensor          # (B, T) long, shifted for the causal-LM loss, IGNORE where unscored
    targets: torch.Tensor         # (B, T) long, unshifted: answer expected from the logits at t, IGNORE elsewhere


def _shift(targets: torch.Tensor) -> torch.Tensor:
    """``labels[:, t + 1] = targets[:, t]`` (the loss predicts ``labels[t + 1]`` from the logits at ``t``)."""
    labels = torch.full_like(targets, IGNORE)
    labels[:, 1:] = targets[:, :-1]
    return labels


def _batch(input_ids: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Batch:
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return Batch(input_ids, attention_mask, _shift(targets), targets)


# --------------------------------------------------------------------------------------------------- parity (S2)

class Parity:
    """Running parity of a bit string. Tokens: 0, 1 (the bits; also the answers), BOS, END."""

    name = "parity"
    BOS, END = 2, 3
    vocab_size = 4

    DENSITIES = ("half", "uniform", "mixed")

    @classmethod
    def sample(cls, batch: int, length: int, generator: torch.Generator, density: str = "half") -> Batch:
        """``density="half"``: fair bits. ``"uniform"``: each string draws its own probability of a 1 from U(0, 1),
        so runs of 0s and of 1s as long as the string occur in training (with fair bits a 40-bit string almost never
        holds more than ~30 of either), and the angle each bit adds is measured over the whole length. ``"mixed"``:
        every other string fair, the rest as ``"uniform"``."""
        if density == "half":
            return cls.from_bits(torch.randint(0, 2, (batch, length), generator=generator))
        if density not in cls.DENSITIES:
            raise ValueError(f"unknown bit density {density!r}; expected one of {cls.DENSITIES}")
        p_one = torch.rand(batch, 1, generator=generator)
        if density == "mixed":
            p_one[::2] = 0.5
        return cls.from_bits((torch.rand(batch, length, generator=generator) < p_one).long())

    @classmethod
    def from_bits(cls, bits: torch.Tensor) -> Batch:
        """The batch for given bit strings ``(B, n)``: ``BOS bits END`` with the running parity as targets."""
        batch, length = bits.shape
        running = torch.cumsum(bits, dim=1) % 2
        input_ids = torch.cat([torch.full((batch, 1), cls.BOS), bits, torch.full((batch, 1), cls.END)], dim=1)
        targets = torch.full_like(input_ids, IGNORE)
        targets[:, 1:length + 1] = running  # the answer read at the position of b_t
        return _batch(input_ids, targets)

    @staticmethod
    def final_position(length: int) -> int:
        """Position (in ``input_ids``) whose logits answer the parity of the whole string."""
        return length


# ------------------------------------------------------------------------------------------------------ A3 (state)

def compose(first: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation "apply ``first``, then ``then``" in one-line notation: ``i -> then[first[i]]``."""
    return tuple(then[i] for i in first)


class A3:
    """Prefix products on A3. Tokens 0, 1, 2 are the group's elements (also the answers), then BOS, END."""

    name = "a3"
    # identity, then the two 3-cycles; ELEMENTS[a] ∘ ELEMENTS[b] = ELEMENTS[(a + b) % 3]
    ELEMENTS = ((0, 1, 2), (1, 2, 0), (2, 0, 1))
    BOS, END = 3, 4
    vocab_size = 5

    @classmethod
    def sample(cls, batch: int, length: int, generator: torch.Generator) -> Batch:
        return cls.from_elements(torch.randint(0, 3, (batch, length), generator=generator))

    @classmethod
    def from_elements(cls, elements: torch.Tensor) -> Batch:
        """The batch for given element indices ``(B, n)``: ``BOS elements END``, prefix products as targets."""
        batch, length = elements.shape
        products = torch.cumsum(elements, dim=1) % 3  # A3 is cyclic: composing rotations adds their indices
        input_ids = torch.cat([torch.full((batch, 1), cls.BOS), elements, torch.full((batch, 1), cls.END)], dim=1)
        targets = torch.full_like(input_ids, IGNORE)
        targets[:, 1:length + 1] = products  # the answer read at the position of g_t
        return _batch(input_ids, targets)

    @staticmethod
    def final_position(length: int) -> int:
        """Position (in ``input_ids``) whose logits answer the product of the whole word."""
        return length


# ----------------------------------------------------------------------------------------------------------- MQAR

class MQAR:
    """Multi-query associative recall. Keys are tokens ``[0, num_keys)``, values ``[num_keys, 2 num_keys)``."""

    name = "mqar"

    def __init__(self, num_keys: int = 32):
        self.num_keys = num_keys
        self.BOS = 2 * num_keys
        self.vocab_size = 2 * num_keys + 1

    def sample(self, batch: int, pairs: int, generator: torch.Generator, queries: int | None = None) -> Batch:
        """``pairs`` key-value pairs (distinct keys), then ``queries`` (default: every key once, shuffled)."""
        if pairs > self.num_keys:
            raise ValueError(f"pairs ({pairs}) must be <= num_keys ({self.num_keys})")
        queries = pairs if queries is None else queries
        keys = torch.argsort(torch.rand(batch, self.num_keys, generator=generator), dim=1)[:, :pairs]
        values = self.num_keys + torch.randint(0, self.num_keys, (batch, pairs), generator=generator)
        if queries <= pairs:  # distinct queries
            which = torch.argsort(torch.rand(batch, pairs, generator=generator), dim=1)[:, :queries]
        else:
            which = torch.randint(0, pairs, (batch, queries), generator=generator)
        asked, answers = keys.gather(1, which), values.gather(1, which)
        context = torch.stack([keys, values], dim=2).flatten(1)
        tail = torch.stack([asked, answers], dim=2).flatten(1)
        input_ids = torch.cat([torch.full((batch, 1), self.BOS), context, tail], dim=1)
        targets = torch.full_like(input_ids, IGNORE)
        start = 1 + 2 * pairs
        targets[:, start:start + 2 * queries:2] = answers  # read at the position of each query
        return _batch(input_ids, targets)


# ----------------------------------------------------------------------------------------------------------- copy

class Copy:
    """String copying. Tokens ``[0, alphabet)`` are letters; then BOS, COPY, EOS, PAD."""

    name = "copy"

    def __init__(self, alphabet: int = 26):
        self.alphabet = alphabet
        self.BOS, self.COPY, self.EOS, self.PAD = alphabet, alphabet + 1, alphabet + 2, alphabet + 3
        self.vocab_size = alphabet + 4

    def sample(self, batch: int, min_length: int, max_length: int, generator: torch.Generator) -> Batch:
        """Strings of lengths uniform in ``[min_length, max_length]``, right-padded to the longest."""
        lengths = torch.randint(min_length, max_length + 1, (batch,), generator=generator)
        width = 2 * int(lengths.max()) + 3
        input_ids = torch.full((batch, width), self.PAD)
        targets = torch.full((batch, width), IGNORE)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        letters = torch.randint(0, self.alphabet, (batch, int(lengths.max())), generator=generator)
        for row, n in enumerate(lengths.tolist()):
            s = letters[row, :n]
            input_ids[row, : 2 * n + 3] = torch.cat([torch.tensor([self.BOS]), s, torch.tensor([self.COPY]), s,
                                                     torch.tensor([self.EOS])])
            attention_mask[row, : 2 * n + 3] = 1
            # after COPY (position n + 1) the answer is s_1, ..., after the last copied letter it is EOS
            targets[row, n + 1: 2 * n + 2] = input_ids[row, n + 2: 2 * n + 3]
        return _batch(input_ids, targets, attention_mask)


TASKS = ("parity", "a3", "mqar", "copy")

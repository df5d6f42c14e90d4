"""The running batch's KV cache: rows right-aligned in one `DynamicCache`, left padding masked out.

Newly admitted requests are prefilled together (left-padded, masked) and then merged into the running
batch by left-padding the narrower side. Every decode step appends one column for
all rows at once; rows leave with an index select, and padding columns no row needs any more are cut.
This is how `generate` handles a left-padded batch, with rows that come and go between steps. The
layers keep spare room along the sequence (`SlabLayer`), so a step writes one column instead of
copying the whole cache as `DynamicLayer`'s concatenation does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

SPARE_COLUMNS = 64


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of larger buffers with room to grow."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._fill(keys, values)

    def _fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, t, d = keys.shape
        room = t + max(SPARE_COLUMNS, t // 2)  # geometric growth: amortised O(1) per column
        self._k = keys.new_empty(b, h, room, d)
        self._v = values.new_empty(b, h, room, values.shape[3])
        self._k[:, :, :t] = keys
        self._v[:, :, :t] = values
        self._len = t
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

    @classmethod
    def stacked(cls, top: tuple[torch.Tensor, torch.Tensor], bottom: tuple[torch.Tensor, torch.Tensor],
                width: int) -> SlabLayer:
        """`top`'s rows above `bottom`'s, each right-aligned at `width` columns (zeros on the left), written once
        into a new slab (not concatenated, then copied into one)."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        keys = top[0]
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        b1, b2 = top[0].shape[0], bottom[0].shape[0]
        room = width + max(SPARE_COLUMNS, width // 2)
        layer._k = keys.new_empty(b1 + b2, keys.shape[1], room, keys.shape[3])
        layer._v = top[1].new_empty(b1 + b2, top[1].shape[1], room, top[1].shape[3])
        for buf, a, b in ((layer._k, top[0], bottom[0]), (layer._v, top[1], bottom[1])):
            for rows, part in ((buf[:b1], a), (buf[b1:], b)):
                pad = width - part.shape[2]
                if pad:
                    rows[:, :, :pad] = 0
                rows[:, :, pad:width] = part
        layer._len = width
        layer.keys, layer.values = layer._k[:, :, :width], layer._v[:, :, :width]
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self._len + n > self._k.shape[2]:
            self._fill(self._k[:, :, : self._len], self._v[:, :, : self._len])
        self._k[:, :, self._len : self._len + n] = key_states
        self._v[:, :, self._len : self._len + n] = value_states
        self._len += n
        self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]
        return self.keys, self.values


def _slab_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [SlabLayer(k, v) for k, v in layers]
    return cache


def layers_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
        out.append((layer.keys, layer.values))
    return out


class DecodeBatch:
    """KV cache of the running rows. `lengths[i]` is how many real tokens row i has in the cache."""

    def __init__(self, cache: DynamicCache | None = None, lengths: list[int] | None = None) -> None:
        self.cache = cache
        self.lengths: list[int] = lengths or []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def extend(self, other: DecodeBatch) -> None:
        """Append the rows of `other` below these, left-padding whichever side is narrower."""
        if other.cache is None:
            return
        if self.cache is None:
            self.cache, self.lengths = other.cache, list(other.lengths)
            return
        width = max(self.width, other.width)
        cache = DynamicCache()
        cache.layers = [SlabLayer.stacked(mine, theirs, width)
                        for mine, theirs in zip(layers_of(self.cache), layers_of(other.cache), strict=True)]
        self.cache = cache
        self.lengths += other.lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order); cut the padding columns that every kept row has."""
        if rows == list(range(len(self.lengths))):
            return
        if not rows or self.cache is None:
            self.cache, self.lengths = None, []
            return
        self.lengths = [self.lengths[r] for r in rows]
        cut = self.width - max(self.lengths)
        index = torch.tensor(rows)
        self.cache = _slab_cache([(k[index, :, cut:], v[index, :, cut:]) for k, v in layers_of(self.cache)])

    def step_inputs(self, last_tokens: list[int]) -> dict[str, object]:
        """Model kwargs for one decode step that feeds each row its last sampled token."""
        width = self.width
        lengths = torch.tensor(self.lengths).unsqueeze(1)  # (B, 1)
        columns = torch.arange(width + 1).unsqueeze(0)  # (1, W + 1)
        return {
            "input_ids": torch.tensor(last_tokens).unsqueeze(1),  # (B, 1)
            "attention_mask": (columns >= width - lengths).long(),  # (B, W + 1), 0 on left padding
            "position_ids": lengths.clone(),  # (B, 1): the new token's position in its own sequence
            "past_key_values": self.cache,
            "use_cache": True,
        }

    def stepped(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]


def prefill(
    model: PreTrainedModel, sequences: list[list[int]], *, all_logits: bool = False
) -> tuple[DecodeBatch, torch.Tensor]:
    """Forward left-padded `sequences` together; return them as a batch and their logits.

    The logits are (B, V) at each row's last position, or (B, T, V) at every position with `all_logits`
    (use that with one sequence: padded positions are not meaningful).

    Identical sequences are computed once and their cache rows and logits copied (a GRPO group's n sessions
    send the same prompt at the same moment; SGLang's prefix cache shares it the same way). Each row still
    samples on its own. Measured on the demo's loop (benchmarks/loop.py): prefill was ~45% of the engine's
    model thread, with 8 copies of each prompt.
    """
    if not all_logits and len(sequences) > 1:
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(s), len(first)) for s in sequences]
        if len(first) < len(sequences):
            layers, logits = _forward(model, [list(s) for s in first])
            index = torch.tensor(rows)
            cache = _slab_cache([(k[index], v[index]) for k, v in layers])
            return DecodeBatch(cache, [len(s) for s in sequences]), logits[index]
    layers, logits = _forward(model, sequences, all_logits=all_logits)
    return DecodeBatch(_slab_cache(layers), [len(s) for s in sequences]), logits


def _forward(
    model: PreTrainedModel, sequences: list[list[int]], *, all_logits: bool = False
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The forward of a prefill: each layer's keys and values (left-padded) and the logits."""
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    pads = torch.tensor([width - n for n in lengths]).unsqueeze(1)  # (B, 1)
    columns = torch.arange(width).unsqueeze(0)  # (1, T)
    cache = DynamicCache()
    out = model(
        input_ids=torch.tensor([[0] * (width - len(s)) + s for s in sequences]),  # (B, T)
        attention_mask=(columns >= pads).long(),
        position_ids=(columns - pads).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
    )
    logits = out.logits.float()
    return layers_of(cache), logits if all_logits else logits[:, -1]

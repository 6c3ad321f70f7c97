"""A slice of a page's KV: a range of its layers and a range of its KV heads.

A tensor-parallel rank holds `H / tp` of a model's KV heads, a pipeline stage a range of its
layers. Pages stay whole in the store, `(L, 2, P, H, D)`, whichever rank wrote them, so an
engine at any degree reuses them: a rank stores its slice as a part of the page
(kvstore/page_parts.py) and fetches its slice from the whole page.

A slice is `(layers, heads)`, each a half-open `(start, stop)` range; `None` for either is all
of it. The whole page is the slice `WHOLE`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.config import ModelSpec
from kvstore.errors import InvalidRequest

Range = tuple[int, int]


@dataclass(frozen=True)
class PageSlice:
    layers: Range | None = None  # [start, stop) of the model's layers; None: all
    heads: Range | None = None  # [start, stop) of the model's KV heads; None: all

    @staticmethod
    def of(spec: ModelSpec, *, layers: Any = None, heads: Any = None) -> "PageSlice":
        """The slice a caller asked for, checked against `spec`: InvalidRequest names the field.
        A range that covers all of its dimension is stored as None, so a slice that is the whole
        page compares equal to `WHOLE`."""
        return PageSlice(_range("layers", layers, spec.num_layers), _range("heads", heads, spec.num_kv_heads))

    @property
    def whole(self) -> bool:
        return self.layers is None and self.heads is None

    def layer_range(self, spec: ModelSpec) -> Range:
        return self.layers or (0, spec.num_layers)

    def head_range(self, spec: ModelSpec) -> Range:
        return self.heads or (0, spec.num_kv_heads)

    def kv_shape(self, spec: ModelSpec, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of this slice of `num_tokens` tokens' KV: (layers, 2, T, heads, D)."""
        l0, l1 = self.layer_range(spec)
        h0, h1 = self.head_range(spec)
        return (l1 - l0, 2, num_tokens, h1 - h0, spec.head_dim)

    def bytes_per_token(self, spec: ModelSpec) -> int:
        l0, l1 = self.layer_range(spec)
        h0, h1 = self.head_range(spec)
        return (l1 - l0) * 2 * (h1 - h0) * spec.head_dim * spec.itemsize

    def take(self, kv: Any) -> Any:
        """This slice of a whole `(L, 2, T, H, D)` tensor or array: a view, no copy."""
        if self.whole:
            return kv
        layers, heads = self.layers, self.heads
        kv = kv if layers is None else kv[layers[0]:layers[1]]
        return kv if heads is None else kv[:, :, :, heads[0]:heads[1]]

    @staticmethod
    def wire_fields(*, layers: Any = None, heads: Any = None) -> dict[str, list[int]]:
        """A client's request fields naming a slice (none for the whole page), their form checked
        here; the store checks them against the model's spec."""
        fields = {}
        for name, value in (("layers", layers), ("heads", heads)):
            if value is not None:
                fields[name] = list(_pair(name, value))
        return fields


WHOLE = PageSlice()  # the whole page: what every call without a slice reads or writes


def _pair(field: str, value: Any) -> Range:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2 \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidRequest(f"{field}: expected (start, stop), two ints, got {value!r}", field=field)
    return int(value[0]), int(value[1])


def _range(field: str, value: Any, size: int) -> Range | None:
    if value is None:
        return None
    start, stop = _pair(field, value)
    if not 0 <= start < stop <= size:
        raise InvalidRequest(f"{field}: expected 0 <= start < stop <= {size} (the model's {field}), "
                             f"got ({start}, {stop})", field=field)
    return None if (start, stop) == (0, size) else (start, stop)

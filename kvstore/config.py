"""Frozen, validated configuration: the model spec of a KV layout and the store's settings.

Everything is checked in `__post_init__`; a mistake raises `ValueError` naming the field and the
allowed range. Derived sizes are properties. This module imports no torch, so the index, keys and
policies stay importable without it.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, astuple, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from kvstore.policies import POLICIES

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
ROPE_STYLES = ("neox", "gptj")
ROPE_SCALING_TYPES = ("linear", "llama3", "dynamic", "yarn", "longrope", "default")
CODECS = ("none", "int8", "fp8")
COMPRESSIONS = ("none", "zstd")
DURABILITIES = ("write-back", "write-through")
MAX_PAGE_SIZE = 4096
MIN_DISK_BYTES = 1 << 20  # LMDB's own pages need room beyond the records


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """A config integer in [lo, hi] (hi None: no upper bound); ValueError names the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: must be {allowed}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The KV layout of one model: what a page holds and how K was rotated.

    A page is a tensor of shape `page_shape = (L, 2, P, H, D)` in `dtype`; index 0 of dim 1 is K
    (already rotated by RoPE at its original positions), 1 is V.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    page_size: int = 16
    rope_theta: float = 10000.0
    rope_style: str = "neox"
    # HF-style rope_scaling: a mapping (or pairs) on construction, kept as sorted (key, value) pairs
    # so the spec stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | Mapping[str, Any] | None = None
    if TYPE_CHECKING:
        # Derived once by _derive(), outside the dataclass's fields (they would enter its hash).
        _hash: int = field(init=False)
        _token_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1, 1024)
        check_int("num_kv_heads", self.num_kv_heads, 1, 1024)
        check_int("head_dim", self.head_dim, 1, 4096)
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        _check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        _check_choice("rope_style", self.rope_style, ROPE_STYLES)
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"rope_theta: must be a finite number > 0, got {self.rope_theta!r}")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        scaling = self.rope_scaling
        if scaling is not None:
            if isinstance(scaling, Mapping):
                scaling = tuple(sorted(scaling.items()))
            try:
                scaling = tuple((str(k), _freeze(v)) for k, v in scaling)
            except (TypeError, ValueError):
                raise ValueError(f"rope_scaling: expected a mapping, got {self.rope_scaling!r}") from None
            kind = dict(scaling).get("rope_type", dict(scaling).get("type"))
            if kind not in ROPE_SCALING_TYPES:
                raise ValueError(f"rope_scaling.rope_type: must be one of {', '.join(ROPE_SCALING_TYPES)}; "
                                 f"got {kind!r}")
            object.__setattr__(self, "rope_scaling", scaling or None)
        self._derive()

    def _derive(self) -> None:
        # A spec keys the store's memo tables on every page operation: its hash and the
        # token's byte count are computed once, not from every field on each lookup.
        object.__setattr__(self, "_hash", hash(astuple(self)))
        object.__setattr__(self, "_token_bytes",
                           self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize)

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, Any]:
        # str hashes differ between processes: a spec sent to another one derives them again.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._derive()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else {k: _thaw(v) for k, v in dict(self.rope_scaling).items()}

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self._token_bytes

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of `num_tokens` tokens: (L, 2, T, H, D)."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        """Build a spec from a mapping (an HTTP body); unknown or missing fields name themselves."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown model spec field (known: {', '.join(sorted(known))})")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if name not in data:
                raise ValueError(f"{name}: required")
        return cls(**dict(data))

    @property
    def fingerprint(self) -> str:
        """A stable hex digest of the spec: part of every namespace, so specs never share pages."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one `KVStore`. Capacities are bytes; 0 disables a tier.

    The top configured tier takes stores (gpu if `gpu_bytes > 0`, else cpu, else disk); a full
    tier demotes its victims to the next tier down and the bottom tier drops them.
    """

    data_dir: str | None = "./kvstore-data"
    cpu_bytes: int = 1 << 30
    gpu_bytes: int = 0
    disk_bytes: int = 16 << 30
    cpu_codec: str = "none"
    disk_codec: str = "none"
    disk_compression: str = "none"
    zstd_level: int = 1
    policy: str = "duel"
    durability: str = "write-back"
    promote_on_hit: bool = True
    redis_url: str | None = None
    redis_key_prefix: str = "kvstore:"
    redis_timeout_s: float = 0.5
    redis_ttl_s: int | None = None
    disk_writer_queue: int = 256
    # Pages written in parts (tensor-parallel ranks each storing their KV heads,
    # kvstore/page_parts.py): how long a page waits for its other parts before it is given up,
    # and how much memory the pages waiting may hold.
    part_timeout_s: float = 30.0
    part_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "gpu_bytes", "disk_bytes"):
            check_int(name, getattr(self, name), 0)
        if 0 < self.disk_bytes < MIN_DISK_BYTES:
            raise ValueError(f"disk_bytes: must be 0 (no disk tier) or >= {MIN_DISK_BYTES} (1MiB), "
                             f"got {self.disk_bytes}")
        _check_choice("cpu_codec", self.cpu_codec, CODECS)
        _check_choice("disk_codec", self.disk_codec, CODECS)
        _check_choice("disk_compression", self.disk_compression, COMPRESSIONS)
        check_int("zstd_level", self.zstd_level, 1, 22)
        _check_choice("durability", self.durability, DURABILITIES)
        check_int("disk_writer_queue", self.disk_writer_queue, 1, 1 << 20)
        _check_choice("policy", self.policy, tuple(POLICIES))
        if not isinstance(self.promote_on_hit, bool):
            raise ValueError(f"promote_on_hit: expected true or false, got {self.promote_on_hit!r}")
        if self.disk_bytes and not self.data_dir:
            raise ValueError("data_dir: required when disk_bytes > 0 (set disk_bytes=0 for no disk tier)")
        if self.durability == "write-through" and not self.disk_bytes:
            raise ValueError("durability: write-through needs a disk tier (disk_bytes > 0)")
        if not (self.cpu_bytes or self.gpu_bytes or self.disk_bytes or self.redis_url):
            raise ValueError("cpu_bytes: at least one tier must have capacity "
                             "(cpu_bytes, gpu_bytes, disk_bytes or redis_url)")
        if not (isinstance(self.redis_timeout_s, (int, float)) and 0 < self.redis_timeout_s <= 60):
            raise ValueError(f"redis_timeout_s: must be in (0, 60], got {self.redis_timeout_s!r}")
        if self.redis_ttl_s is not None:
            check_int("redis_ttl_s", self.redis_ttl_s, 1)
        if isinstance(self.part_timeout_s, bool) or not isinstance(self.part_timeout_s, (int, float)) \
                or not 0 < self.part_timeout_s <= 3600:
            raise ValueError(f"part_timeout_s: must be in (0, 3600] seconds, got {self.part_timeout_s!r}")
        check_int("part_bytes", self.part_bytes, 0)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Configured tiers, top first."""
        names = []
        if self.gpu_bytes:
            names.append("gpu")
        if self.cpu_bytes:
            names.append("cpu")
        if self.disk_bytes:
            names.append("disk")
        if self.redis_url:
            names.append("redis")
        return tuple(names)

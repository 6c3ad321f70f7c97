"""The connector's settings: `kv_connector_extra_config`, read into one frozen, validated dataclass.

    {"url": "http://127.0.0.1:8100", "token": "...", "tokens": {"<cache_salt>": "<token>"},
     "shared_memory_bytes": "256MiB", "kv_events_endpoint": "tcp://127.0.0.1:5557",
     "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}                                      a sidecar
    {"data_dir": "./kvstore-data", "cpu_bytes": "8GiB", "disk_bytes": "64GiB", ...}            in-process

plus, in both, `model` (the store's model name), `timeout_s`, `page_size`, `audit_rate` (the
probability that a hit is audited, 0 to 1, default 0: kvstore/integrations/vllm_audit.py) and
`audit_tokens` (how many tokens of an audited hit's last block vLLM computes and compares, 1 to
block_size, default 1). The
in-process keys are `StoreConfig`'s fields, with the names and units of `kvstore serve` (sizes
like "1GiB").
An unknown key, or a sidecar key mixed with store keys, is an error that names it.

Tenancy and salts: a sidecar takes the tenant from the bearer token (api/server/auth.py): `token` for
every request, or the token `tokens` names for a request's `cache_salt` (a salt that should
count against a tenant of its own). In-process there is one tenant, the default. Within its
tenant, a request's `cache_salt` is the store's salt: a salted request hits only what requests
with the same salt stored, whatever the tokens.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore import StoreConfig
from kvstore.kv_events.wire import check_endpoints
from kvstore.reuse_audit import DEFAULT_AUDIT_RATE, check_audit_rate
from kvstore.sizes import parse_bytes

SIDECAR_KEYS = ("url", "token", "tokens", "shared_memory_bytes", "kv_events_endpoint", "kv_events_replay_endpoint")
COMMON_KEYS = ("model", "timeout_s", "page_size", "retry_after_s", "load_async", "audit_rate", "audit_tokens")
DEFAULT_AUDIT_TOKENS = 1  # of an audited hit's last block, computed by vLLM and compared (vllm_audit.py)
STORE_KEYS = tuple(f.name for f in dataclasses.fields(StoreConfig))
DEFAULT_PAGE_SIZE = 16  # the decode loop's (decode/loader.py): the same pages serve both


@dataclass(frozen=True)
class ConnectorConfig:
    """`url` set: talk to that sidecar; else `store` configures an in-process `KVStore`."""

    url: str | None = None
    token: str | None = None  # bearer token of requests (a salt in `tokens` uses that one instead)
    tokens: tuple[tuple[str, str], ...] = ()  # (cache_salt, bearer token) pairs, sorted
    shared_memory_bytes: int | None = None  # the client's arena (None: 256 MiB on loopback, 0: off, TCP only)
    store: StoreConfig | None = None
    model: str | None = None  # None: vLLM's served model name (a directory's own name for a path)
    timeout_s: float = 5.0  # longest a step waits on the store; past it the tokens are recomputed
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per store page; must divide vLLM's block_size
    retry_after_s: float = 10.0  # after a failure, the store is left alone this long
    # Loads run beside the forward, while their requests wait outside the batch (vLLM's
    # WAITING_FOR_REMOTE_KVS), instead of inside the step of the batch they join.
    load_async: bool = False
    # The probability that a hit is audited: its last full block computed by vLLM and compared
    # with the stored one (vllm_audit.py); 0: off.
    audit_rate: float = DEFAULT_AUDIT_RATE
    # How many of the audited block's last tokens vLLM computes and compares: up to vLLM's
    # block_size (the whole block); fewer cost less prefill (vllm_audit.py says what each sees).
    audit_tokens: int = DEFAULT_AUDIT_TOKENS
    # The sidecar's KV events (its --kv-events-endpoint / --kv-events-replay-endpoint), which
    # take_events() turns into the engine's own when vLLM publishes KV events.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (self.store is None):
            raise ValueError("url: give either url (a sidecar) or store settings (in-process), not both")
        if self.url is not None and (not isinstance(self.url, str) or not self.url.startswith("http://")):
            raise ValueError(f"url: expected http://host:port, got {self.url!r}")
        for name in ("timeout_s", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value <= 3600:
                raise ValueError(f"{name}: must be a number of seconds in (0, 3600], got {value!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or not 1 <= self.page_size <= 4096:
            raise ValueError(f"page_size: must be an integer in [1, 4096], got {self.page_size!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model: expected a non-empty string, got {self.model!r}")
        if self.shared_memory_bytes is not None and (isinstance(self.shared_memory_bytes, bool) or not isinstance(
                self.shared_memory_bytes, int) or self.shared_memory_bytes < 0):
            raise ValueError(f"shared_memory_bytes: expected a byte count >= 0, got {self.shared_memory_bytes!r}")
        check_audit_rate(self.audit_rate)
        if isinstance(self.audit_tokens, bool) or not isinstance(self.audit_tokens, int) \
                or not 1 <= self.audit_tokens <= 4096:
            raise ValueError(f"audit_tokens: must be an integer in [1, vLLM's block_size], got {self.audit_tokens!r}")
        if not isinstance(self.load_async, bool):
            raise ValueError(f"load_async: expected true or false, got {self.load_async!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("token: expected a non-empty string")
        check_endpoints(self.kv_events_endpoint, self.kv_events_replay_endpoint)

    def token_for(self, salt: str | None) -> str | None:
        """The bearer token of requests with `salt`: the one `tokens` names for it, else `token`."""
        return self.token if salt is None else dict(self.tokens).get(salt, self.token)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Read `kv_connector_extra_config`. ValueError names the key at fault."""
        extra = dict(extra or {})
        known = set(SIDECAR_KEYS) | set(COMMON_KEYS) | set(STORE_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        store_keys = sorted(set(extra) & set(STORE_KEYS))
        if "url" in extra and store_keys:
            raise ValueError(f"kv_connector_extra_config.{store_keys[0]}: a store setting, but url names a sidecar; "
                             f"configure that sidecar instead (kvstore serve)")
        sidecar_only = sorted(set(extra) & (set(SIDECAR_KEYS) - {"url"}))
        if "url" not in extra and sidecar_only:
            raise ValueError(f"kv_connector_extra_config.{sidecar_only[0]}: a sidecar setting; set url too")
        kwargs: dict[str, Any] = {}
        try:
            for name in COMMON_KEYS:
                if name in extra:
                    kwargs[name] = extra[name]
            if "url" in extra:
                kwargs["url"], kwargs["token"] = extra["url"], extra.get("token")
                kwargs["tokens"] = _salt_tokens(extra.get("tokens", {}))
                for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
                    if name in extra:
                        kwargs[name] = extra[name]
                if "shared_memory_bytes" in extra:
                    kwargs["shared_memory_bytes"] = parse_bytes(extra["shared_memory_bytes"],
                                                                field="shared_memory_bytes")
            else:
                kwargs["store"] = StoreConfig(**{k: _store_value(k, extra[k]) for k in store_keys})
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv_connector_extra_config.{exc}") from None


def _salt_tokens(tokens: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(tokens, Mapping) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in tokens.items()):
        raise ValueError('tokens: expected {"<cache_salt>": "<bearer token>", ...}')
    return tuple(sorted(tokens.items()))


_STORE_HINTS = typing.get_type_hints(StoreConfig)


def _store_value(name: str, value: Any) -> Any:
    """A StoreConfig field from JSON: sizes take units, as `kvstore serve`'s flags do."""
    if name.endswith("_bytes"):
        return parse_bytes(value, field=name)
    hint = _STORE_HINTS[name]
    if hint is float or (typing.get_origin(hint) is typing.Union and float in typing.get_args(hint)):
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
    return value

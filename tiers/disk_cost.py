"""What a record costs in LMDB, for the store's disk accounting (an estimate that errs high).

LMDB keeps a value larger than about half a page (4 KiB pages) in its own run of overflow
pages, so its cost is its size rounded up to whole pages; small values share leaf pages, which
B-tree splits leave about half full. Each record is a header value plus a payload value.
"""
from __future__ import annotations

LMDB_PAGE_BYTES = 4096
_OVERFLOW_THRESHOLD = 2000
_NODE_OVERHEAD_BYTES = 16 + 16  # node header + our 16-byte key


def lmdb_value_cost(nbytes: int) -> int:
    if nbytes > _OVERFLOW_THRESHOLD:
        return -(-(nbytes + _NODE_OVERHEAD_BYTES) // LMDB_PAGE_BYTES) * LMDB_PAGE_BYTES
    return 2 * (nbytes + _NODE_OVERHEAD_BYTES)


def disk_record_cost(payload_bytes: int, num_tokens: int) -> int:
    header_bytes = 160 + 4 * num_tokens
    return lmdb_value_cost(payload_bytes) + lmdb_value_cost(header_bytes)

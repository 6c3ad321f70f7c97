"""Limits every side checks a request against: the store, the sidecar and the client's encoder.

A leaf (no imports), so the client checks a request as the store would without loading it.
"""

MAX_TOKENS = 1 << 21  # per request; longer prompts are refused before any work
MAX_SALT_BYTES = 1024  # a cache salt names a user or conversation: a longer one is a mistake, not a name

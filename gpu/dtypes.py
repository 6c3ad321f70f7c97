"""The KV dtypes: the model dtypes a page may hold (`ModelSpec.dtype`), by name.

One table for every layer that needs torch dtypes: the store's codecs and input checks
(kvstore/codecs.py `TORCH_DTYPES` is this table), its numpy page copies (kvstore/copy.py derives
its view dtypes from it) and the kernels, whose names end in the dtype's name (kernels.cu). It
lives here because gpu/ is the leaf package: it imports torch and nothing of the store.
`ModelSpec` (kvstore/config.py, which imports no torch) names the same dtypes with their sizes.
"""
from __future__ import annotations

import torch

KV_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KV_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in KV_DTYPES.items()}

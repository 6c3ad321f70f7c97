"""The KV dtypes: the model dtypes a page may hold (`ModelSpec.dtype`), by name, and how torch and
numpy hold their bits. The one dtype table of the store and the kernels.

Everything that maps a KV dtype takes it from here: the codecs and input checks
(`KV_DTYPES`, under this one name everywhere), the numpy page copies (kvstore/host_copy.py,
the fetch answer: `NUMPY_DTYPES`, `BITS_DTYPES`), the kernels' wrappers, whose kernel names end
in the dtype's name (kernels.cu), and the bit-exact paged copies (gpu/paged.py). It lives here
because gpu/ is the leaf package: it imports torch and nothing of the store. `ModelSpec`
(kvstore/config.py, which imports no torch) names the same dtypes with their sizes; a test holds
the two to each other.
"""
from __future__ import annotations

import numpy as np
import torch

KV_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KV_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in KV_DTYPES.items()}

# An integer dtype of each width: a tensor viewed as one of these has the same bits, so copies
# through it are bit-exact for any dtype (bfloat16, which numpy lacks; fp8, whose index kernels
# torch does not always have).
BITS_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The torch dtypes numpy holds as they are (`Tensor.numpy()` works); any other goes through its
# width's BITS_DTYPES.
NUMPY_NATIVE: frozenset[torch.dtype] = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                                  torch.float16, torch.float32, torch.float64})


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds a CPU tensor of `dtype` bit for bit."""
    held = dtype if dtype in NUMPY_NATIVE else BITS_DTYPES[dtype.itemsize]
    return torch.empty(0, dtype=held).numpy().dtype


# The KV dtypes numpy has (not bfloat16), by name: tensors of these are viewed and typed by
# numpy, several times cheaper than torch's views, on the wire's hot paths.
NUMPY_KV_DTYPES: dict[str, np.dtype] = {name: torch.empty(0, dtype=dtype).numpy().dtype
                                        for name, dtype in KV_DTYPES.items() if dtype in NUMPY_NATIVE}

# The numpy dtype of each KV dtype's page bytes: bfloat16 as its bits (int16), so copies stay
# bit-exact.
NUMPY_DTYPES: dict[str, np.dtype] = {name: _numpy_dtype(dtype) for name, dtype in KV_DTYPES.items()}

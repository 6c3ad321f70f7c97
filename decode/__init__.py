"""decode: a Llama-style torch decode loop that reuses cached KV through a `KVCacheBackend`.

    from kvstore.decode import generate, load_model
    model = load_model("smollm2")       # a known model (pulled once), a checkpoint directory, or "tiny"
    result = generate(model, [{"role": "user", "content": "Name three colors."}], 32, backend=store)
    result.text                          # "1. Red\n2. Blue\n3. Green"; token ids work too
"""
from kvstore.decode.arch import LlamaArch
from kvstore.decode.engine import GenerateResult, generate
from kvstore.decode.loader import load_checkpoint, load_model, tiny_model
from kvstore.decode.model import LlamaModel
from kvstore.decode.reuse import BackendWarning
from kvstore.decode.sampling import SamplingParams

__all__ = ["LlamaArch", "LlamaModel", "GenerateResult", "generate", "load_checkpoint", "load_model", "tiny_model",
           "BackendWarning", "SamplingParams"]

"""decode: a Llama-style torch decode loop that reuses cached KV through a `KVCacheBackend`.

    from kvstore.decode import generate, load_checkpoint, tiny_model
    model = load_checkpoint("path/to/hf-llama")          # or tiny_model() (random weights)
    result = generate(model, prompt_tokens, 32, backend=store)
"""
from kvstore.decode.arch import LlamaArch
from kvstore.decode.engine import GenerateResult, generate
from kvstore.decode.loader import load_checkpoint, tiny_model
from kvstore.decode.model import LlamaModel
from kvstore.decode.reuse import BackendWarning
from kvstore.decode.sampling import SamplingParams

__all__ = ["LlamaArch", "LlamaModel", "GenerateResult", "generate", "load_checkpoint", "tiny_model",
           "BackendWarning", "SamplingParams"]

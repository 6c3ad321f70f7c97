"""decode: a Llama-style torch decode loop that reuses cached KV through a `KVCacheBackend`.

    from decode import generate, load_checkpoint, tiny_model
    model = load_checkpoint("path/to/hf-llama")          # or tiny_model() (random weights)
    result = generate(model, prompt_tokens, 32, backend=store)
"""
from decode.arch import LlamaArch
from decode.engine import GenerateResult, generate
from decode.loader import load_checkpoint, tiny_model
from decode.model import LlamaModel
from decode.reuse import BackendWarning
from decode.sampling import SamplingParams

__all__ = ["LlamaArch", "LlamaModel", "GenerateResult", "generate", "load_checkpoint", "tiny_model",
           "BackendWarning", "SamplingParams"]

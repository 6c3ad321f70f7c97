"""`kvstore proxy`: the prefill/decode proxy in front of vLLM engines (prefill_decode.py). It is
a client of the engines only, never of the sidecar's server or client code.
"""

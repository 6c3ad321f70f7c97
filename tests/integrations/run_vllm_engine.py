"""Run one fresh vLLM engine with the kvstore connector in this process and print what it did.

    python run_vllm_engine.py '{"model": DIR, "extra": {...}, "prompts": [[...], ...],
                                "max_tokens": 8, "engine": {...}, "salts": [null | "salt", ...],
                                "connector_module": "kvstore.integrations.vllm"}'

prints one line `RESULT {"outputs": [{"tokens": [...], "cached": n}, ...]}`. The end-to-end
tests start it as a new process: an engine whose own prefix cache is empty, as a restarted
server's would be."""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    module = job.get("connector_module", "kvstore.integrations.vllm")
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path=module,
                                kv_role="kv_both", kv_connector_extra_config=job["extra"])
    llm = LLM(job["model"], kv_transfer_config=transfer, **job["engine"])
    salts = job.get("salts") or [None] * len(job["prompts"])
    prompts = [TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))
               for p, salt in zip(job["prompts"], salts)]
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False)
    outputs = []
    for prompt in prompts:  # one at a time: each result is its own request's
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        outputs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    print("RESULT " + json.dumps({"outputs": outputs}), flush=True)
    llm.llm_engine.engine_core.shutdown()  # the connector closes its store: memory pages reach the disk


if __name__ == "__main__":
    main()

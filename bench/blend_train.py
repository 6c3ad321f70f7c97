"""Train the small Llama of bench/blend_quality.py on the task of bench/blend_task.py.

    python bench/blend_quality.py --train      # calls train() and saves bench/models/blend-task/

Training uses transformers' `LlamaForCausalLM` (autograd, batched) and saves it with
`save_pretrained`, so the evaluation loads it through decode/loader.py like any HF checkpoint.
Fresh random prompts every step (no epochs, nothing to overfit), loss only on answer tokens,
seeded: the same command gives the same weights on the same torch build. It trains on full
prompts only; nothing here knows about chunks or KV reuse.
"""
from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import blend_task as task

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 176, 3, 4, 2
BATCH, QUESTIONS_PER_SEQUENCE = 32, 8
AUX_WEIGHT = 0.3  # the filler progressions: enough to shape fillers' attention, not to distract
LR, WARMUP_STEPS = 3e-3, 100


def hf_config():  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=task.VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HIDDEN // HEADS, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=task.BOS,
                       eos_token_id=None, pad_token_id=task.PAD, torch_dtype="float32")


def batch(rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, answer labels, filler labels), each (size, T), right-padded (causal attention
    never looks right). Labels are the token at that index (-100 elsewhere): the model's logits
    at index - 1 predict them."""
    seqs = [task.training_sequence(rng, rng.randint(4, 6), QUESTIONS_PER_SEQUENCE) for _ in range(size)]
    width = max(len(s) for s, _, _ in seqs)
    ids = torch.full((size, width), task.PAD, dtype=torch.long)  # (B, T)
    answers = torch.full((size, width), -100, dtype=torch.long)  # (B, T)
    fillers = torch.full((size, width), -100, dtype=torch.long)  # (B, T)
    for row, (seq, answer_at, filler_at) in enumerate(seqs):
        ids[row, :len(seq)] = torch.tensor(seq)
        answers[row, answer_at] = ids[row, answer_at]
        fillers[row, filler_at] = ids[row, filler_at]
    return ids, answers, fillers


def losses(model, ids: torch.Tensor, answers: torch.Tensor, fillers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits[:, :-1]  # (B, T - 1, V): position t predicts t + 1
    ce = torch.nn.functional.cross_entropy
    return (ce(logits.flatten(0, 1), answers[:, 1:].flatten(), ignore_index=-100),
            ce(logits.flatten(0, 1), fillers[:, 1:].flatten(), ignore_index=-100))


@torch.no_grad()
def accuracy(model, rng: random.Random, size: int) -> float:  # model: LlamaForCausalLM
    ids, answers, _ = batch(rng, size)
    logits = model(input_ids=ids).logits  # (B, T, V)
    where = answers[:, 1:] != -100
    return (logits[:, :-1].argmax(-1)[where] == answers[:, 1:][where]).float().mean().item()


def train(out_dir: Path, *, steps: int, seed: int = 0, threads: int | None = None) -> dict[str, float]:
    from transformers import LlamaForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = LlamaForCausalLM(hf_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    started = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step", file=sys.stderr)
    for step in bar:
        main, aux = losses(model, *batch(rng, BATCH))
        loss = main + AUX_WEIGHT * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(answer=f"{main.item():.3f}", filler=f"{aux.item():.3f}")
        if step % 250 == 0 or step == steps - 1:
            acc = accuracy(model.eval(), random.Random(10_000 + step), 64)
            model.train()
            bar.write(f"step {step}: answer loss {main.item():.4f}, filler loss {aux.item():.4f}, "
                      f"answer accuracy {acc:.3f}, {time.perf_counter() - started:.0f} s")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    final = accuracy(model, random.Random(seed + 1), 256)
    return {"steps": steps, "train_s": time.perf_counter() - started, "final_answer_accuracy": final}

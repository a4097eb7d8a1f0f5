"""Colocated training loop: optax trains a tiny model while an LLM in the same process serves it.

Every few steps the trainer's params go straight into `llm.update_weights`
(device arrays, no checkpoint, no copy when they already sit on the engine's
sharding) and the engine generates from them: the weights version goes up by
one per update and the sample drifts toward the target sentence as the loss
falls.

    python examples/train_and_serve.py [--steps 60] [--every 10] [--tp 1]

With --tp > 1 on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8
first; the trainer's params are then resharded device-to-device into the
engine's tensor-parallel layout on every update.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint
from hotswap.model.forward import token_logprobs

TARGET = "The robot counted the boats and wrote the number in a notebook."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="push weights and sample every N steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the serving engine")
    args = ap.parse_args()
    t0 = time.monotonic()

    model_dir = create_checkpoint(tempfile.mkdtemp(prefix="hotswap-train-"), preset="tiny", seed=0)
    llm = LLM(
        model_dir, max_model_len=64, page_size=16, max_num_seqs=2, tensor_parallel_size=args.tp, warmup=False
    )
    cfg, tok = llm.config, llm.tokenizer
    ids = tok.encode(TARGET)  # BOS + the sentence
    prompt, n_new = ids[:3], len(ids) - 3
    tokens = jnp.asarray([ids], jnp.int32)  # [1, L]
    lengths = jnp.asarray([len(ids)], jnp.int32)
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)

    # The trainer owns its own copy: host numpy -> default device. (Sharing the engine's
    # buffers would be fine too, but then the step below must not donate them.)
    params = jax.tree.map(jnp.asarray, jax.device_get(llm.params))
    opt = optax.adam(args.lr)
    opt_state = opt.init(params)

    def loss_fn(p):
        # Cross-entropy of every next token of the target, teacher-forced.
        return -jnp.mean(token_logprobs(p, tokens, lengths, cfg=cfg))

    @jax.jit  # no donation: the engine may be serving these very arrays
    def train_step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    print(f"target: {TARGET!r}  ({len(ids)} tokens, prompt {tok.decode(prompt)!r})", flush=True)
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state)
        if step % args.every == 0 or step == 1:
            version = llm.update_weights(params)  # in place: next request sees the new weights
            out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
            print(
                f"step {step:4d}  loss {float(loss):.4f}  weights_version {version}  "
                f"sample {out.text!r}  versions_used {sorted(set(out.weights_versions))}",
                flush=True,
            )
    final = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    print(f"final sample {final.text!r}  matches_target {tok.decode(prompt) + final.text == TARGET}")
    print(f"done in {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()

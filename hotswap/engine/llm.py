"""LLM: the facade for notebooks and training loops (vLLM's names)."""

from __future__ import annotations

import dataclasses
import html
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.args import EngineArgs
from hotswap.checkpoint import gguf_io, hf, hub
from hotswap.checkpoint.tokenizer import Tokenizer
from hotswap.engine.adapters import LoRARequest
from hotswap.engine.chat import chat_prompt, conversations
from hotswap.engine.engine import Engine
from hotswap.engine.outputs import RequestOutput
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.state import EngineState
from hotswap.engine_config import EngineConfig, default_dtype
from hotswap.errors import EngineAsleep, RequestError
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.model.forward import token_logprobs_jit
from hotswap.programs import catalog, kv_sizing
from hotswap.toolcalls import formats
from hotswap.toolcalls.choice import ToolChoice
from hotswap.weights import quantize
from hotswap.weights.options import UpdateOptions


class LLM:
    """Load an HF-format model directory, a GGUF file or a Hub ID, and generate, score and hot-swap weights.

    >>> llm = LLM(model_dir)                                     # doctest: +SKIP
    >>> llm = LLM("org/name", revision="main")   # Hub ID, through the HF cache  # doctest: +SKIP
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))    # doctest: +SKIP
    >>> llm.update_weights(new_params)   # version + 1, cache emptied, nothing stale  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | Path,
        *,
        args: EngineArgs | None = None,
        mesh: jax.sharding.Mesh | None = None,
        **kwargs,
    ):
        """`kwargs`: the engine options, exactly `EngineArgs`' fields (`max_model_len`, `page_size`,
        `dtype`, `revision`, ...; docs/en/python_api.md lists them), on top of `args`. `mesh`: a
        ready `jax.sharding.Mesh` (its `tp` axis) instead of `tensor_parallel_size`."""
        eargs = EngineArgs.of(args, kwargs)
        self.model_dir = hub.locate(model, eargs.revision)  # a local path as is; "org/name" via the HF cache
        self.model_id = hub.display_name(model, self.model_dir)
        dtype = eargs.dtype or default_dtype(jax.default_backend())
        if eargs.quantization == "gguf" and dtype is None:
            dtype = "bfloat16"  # what is not served as blocks: never widened to f32 unless asked
        if gguf_io.is_gguf(self.model_dir):  # a llama.cpp file: config and tokenizer from its metadata
            f = gguf_io.GGUFFile(self.model_dir)
            mcfg = gguf_io.model_config(f, dtype=dtype)
            tokenizer = gguf_io.tokenizer_from_metadata(f.metadata, where=str(f.path))
        else:
            mcfg = ModelConfig.from_hf(hf.read_hf_config(self.model_dir), dtype=dtype)
            has_tok = (self.model_dir / "tokenizer.json").exists()
            tokenizer = Tokenizer.from_dir(self.model_dir) if has_tok else None
        # The weights are read, checked and placed by the engine, as an update is (`weights/`).
        self.engine = _start_engine(mcfg, self.model_dir, tokenizer, eargs, mesh)
        self.tool_parser = formats.choose(
            eargs.tool_call_parser, tokenizer.chat_template if tokenizer else None
        )

    @classmethod
    def from_flax(
        cls,
        model,
        *,
        tokenizer: Tokenizer | None = None,
        args: EngineArgs | None = None,
        mesh: jax.sharding.Mesh | None = None,
        lora_alpha: float | None = None,
        **kwargs,
    ) -> LLM:
        """An engine serving a Flax NNX model held in memory (Tunix Llama3, Qwen2, Qwen3), no
        checkpoint directory: its params are mapped by the spec table (`weights/nnx.py`),
        leaf to leaf, no copy where already on the engine's sharding. `args`, `mesh` and `kwargs` are
        `LLM(...)`'s engine options, but for `dtype` and `revision` (the model's own).
        A model with qwix LoRA factors (`nnx.LoRAParam`) serves its base weights (version 1)
        with the adapter merged (version 2), scaled by `lora_alpha` (default: the qwix rule's) / r.

        >>> llm = LLM.from_flax(tunix_model, tokenizer=Tokenizer.from_dir(d))   # doctest: +SKIP
        >>> llm.update_weights(nnx.state(tunix_model, nnx.Param))              # doctest: +SKIP
        """
        from hotswap.weights import nnx as nnx_params  # the [tunix] extra: flax

        eargs = EngineArgs.of(args, kwargs, "LLM.from_flax")
        for name in ("dtype", "revision"):  # the model in memory has its own dtype and no revision
            if getattr(eargs, name) is not None:
                raise TypeError(f"LLM.from_flax() takes no {name!r}: the model in memory has its own")
        mcfg = nnx_params.model_config(
            model,
            max_position_embeddings=eargs.max_model_len or 4096,
            eos_token_ids=(tokenizer.eos_token_id,)
            if tokenizer and tokenizer.eos_token_id is not None
            else (),
        )
        self = cls.__new__(cls)
        self.model_dir, self.model_id = None, type(model).__name__
        adapter = nnx_params.lora_state(model)
        has_lora = bool(jax.tree.leaves(adapter))
        base = nnx_params.base_state(model) if has_lora else model
        self.engine = _start_engine(mcfg, base, tokenizer, eargs, mesh)  # staged as an update is
        if has_lora:
            alpha = lora_alpha if lora_alpha is not None else nnx_params.qwix_lora_alpha(model)
            self.engine.update_weights(adapter, lora_alpha=alpha)
        self.tool_parser = formats.choose(
            eargs.tool_call_parser, tokenizer.chat_template if tokenizer else None
        )
        return self

    # ---- views ---------------------------------------------------------------

    @property
    def config(self):
        return self.engine.mcfg

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def state(self) -> EngineState:
        return self.engine.state

    @property
    def params(self):
        return self.engine.state.params

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    # ---- generation ------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.
        `lora_request` (vLLM's `LoRARequest`, one or one per prompt; needs `enable_lora`): the
        adapter each prompt is served with, loaded from its path on first use; prompts of
        different adapters and of the base model share every step."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError(f"{len(loras)} lora requests for {len(prompts)} prompts")
        for r in {r for r in loras if r is not None}:
            self._ensure_lora(r)
        done: dict[str, RequestOutput] = {}
        ids = []
        for prompt, sp, lr in zip(prompts, params, loras, strict=True):
            ids.append(
                self.engine.add_request(
                    None,
                    prompt,
                    sp or SamplingParams(),
                    sink=lambda o: done.__setitem__(o.request_id, o),
                    lora_name=lr.lora_name if lr is not None else None,
                )
            )
        bar = None
        if use_tqdm:  # imported only when asked: tqdm.auto warns in notebooks without ipywidgets
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="hotswap: generating", leave=False)
        while any(i not in done for i in ids):
            before = len(done)
            self.engine.step()
            if bar is not None:
                bar.update(len(done) - before)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or a list of them, rendered by the
        chat template (or `chat_template`) exactly as /v1/chat/completions renders them, then generated.

        Each output's `prompt` is the rendered text, `prompt_token_ids` the template's ids.
        `tools`, `tool_choice`, `parallel_tool_calls`: OpenAI's, as the server takes them (a
        `required` or named choice constrains the output); read the calls out of an output's text
        with `hotswap.toolcalls.parse_tool_calls(text, llm.tool_parser, tool_choice)`.
        """
        choice = ToolChoice.of(tools, tool_choice, parallel_tool_calls)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        sps = [
            dataclasses.replace(
                sp, **choice.sampling_overrides(self.tool_parser, sp.structured_outputs is not None)
            )
            for sp in (p or SamplingParams() for p in sps)
        ]
        prompts = [
            chat_prompt(
                self.tokenizer,
                conv,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=choice.offered,
                tool_format=self.tool_parser,
            )
            for conv in conversations(messages)
        ]
        params = sps if isinstance(sampling_params, list) else sps[0]
        outs = self.generate([ids for _, ids in prompts], params, use_tqdm)
        return [dataclasses.replace(o, prompt=text) for o, (text, _) in zip(outs, prompts, strict=True)]

    def score(self, prompt_token_ids, completion_token_ids=None, *, temperature: float = 1.0):
        """Teacher-forced log-probs of completion tokens given the prompt (raw distribution, or
        with `temperature` the distribution softmax(logits / temperature) a sampler at that
        temperature draws from, before any top-k/top-p cut).

        `score(prompt, completion) -> np.ndarray[len(completion)]`, or
        `score([(prompt, completion), ...]) -> list[np.ndarray]`.
        """
        if not temperature > 0:
            raise RequestError(f"score needs temperature > 0, got {temperature}")
        single = completion_token_ids is not None
        pairs = [(prompt_token_ids, completion_token_ids)] if single else list(prompt_token_ids)
        state = self.engine.state  # read once: a sleep in another thread swaps the whole value
        if not state.serving:
            raise EngineAsleep("the engine is asleep: wake it up before scoring")
        params = state.params
        seqs = [list(map(int, p)) + list(map(int, c)) for p, c in pairs]
        for (p, _), s in zip(pairs, seqs, strict=True):
            if not p:
                raise RequestError("score needs a non-empty prompt")
            if any(not 0 <= t < self.config.vocab_size for t in s):
                raise RequestError("token id outside the vocabulary")
        max_len = max(len(s) for s in seqs)
        length = 64 * math.ceil(max_len / 64)  # pad to few shapes: few compilations
        batch = 1 << max(0, math.ceil(math.log2(len(seqs))))
        toks = np.zeros((batch, length), np.int32)
        lens = np.zeros(batch, np.int32)
        for i, s in enumerate(seqs):
            toks[i, : len(s)], lens[i] = s, len(s)
        t = jnp.float32(temperature)
        # The engine's Backend: in deterministic mode its step kernels, so a score is the bits a
        # generation of the same tokens returned.
        backend = self.engine.backend
        lp = token_logprobs_jit(
            params, jnp.asarray(toks), jnp.asarray(lens), t, cfg=self.config, backend=backend
        )
        lp = np.asarray(lp)
        out = [lp[i, len(p) - 1 : len(s) - 1] for i, ((p, _), s) in enumerate(zip(pairs, seqs, strict=True))]
        return out[0] if single else out

    # ---- lifecycle -------------------------------------------------------------

    def update_weights(
        self, source, options: UpdateOptions | None = None, *, draft: bool = False, **fields
    ) -> int:
        """Swap in new weights (pytree, HF-named dict, checkpoint dir, .gguf file, safetensors bytes,
        a `hotswap.weights.transfer.TransferRef` another JAX process published: pulled device to device, or a
        Flax NNX `nnx.State` / `nnx.Module` of the served model's family: mapped leaf to leaf), or a
        LoRA adapter (a PEFT directory, bytes or tensors, an NNX state of `nnx.LoRAParam` leaves, a
        params-layout tree of `lora_a` / `lora_b` factors): merged on the device into the base
        weights, which the engine keeps, as W + (lora_alpha / r)·A·B; `lora_alpha` where the
        source does not state it (a PEFT directory's adapter_config.json does).

        `options` (`hotswap.UpdateOptions`), or its fields as keywords: `policy`, `version`,
        `partial`, `base_version`, `drain_timeout_s`, `check_finite`, `lora_alpha`.

        A delta (`base_version=v`): only the HF-named tensors that changed, or their changed
        rows (`hotswap.weights.delta.Rows`; `delta.changed(old, new)` computes it), applied only
        while version v serves (else `BaseVersionMismatch`, 409, nothing changed).

        Returns the new weights version. The prefix cache is emptied; a rejected
        update raises a typed error and the old weights keep serving.

        `draft=True` (speculative_config with a draft checkpoint): `source` replaces the
        draft's weights instead, in place; returns the draft's new version (the target's
        version and cache are untouched).
        """
        if draft:
            return self.engine.update_weights(source, options, draft=True, **fields)
        return self.engine.update_weights(source, UpdateOptions.of(options, **fields))

    def _ensure_lora(self, request: LoRARequest) -> None:
        loaded = {a.name: a for a in self.engine.lora_adapters()}
        have = loaded.get(request.lora_name)
        if request.lora_path and (have is None or have.source != request.lora_path):
            self.engine.load_lora_adapter(request.lora_name, request.lora_path)

    def load_lora_adapter(self, name: str, source, *, lora_alpha: float | None = None):
        """Load or reload (version + 1) the adapter served as `name` (`enable_lora`): a PEFT
        directory, PEFT-named safetensors bytes or tensors. Returns its record (slot, version)."""
        return self.engine.load_lora_adapter(name, source, lora_alpha=lora_alpha)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora_adapter(name)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.engine.sleep(level, mode)

    def wakeup(self, tags: list[str] | None = None) -> None:
        self.engine.wakeup(tags)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    # ---- notebook view ---------------------------------------------------------

    def cache_usage(self) -> dict:
        st = self.engine.state
        return {"pages": st.num_pages - 1, **st.pool.usage(st.prefix)}

    def __repr__(self) -> str:
        u = self.cache_usage()
        return (
            f"LLM({self.model_id}, arch={self.config.arch}, weights_version={self.weights_version}, "
            f"asleep={sorted(self.engine.state.asleep)}, pages owned/cached/free={u['owned']}/{u['cached']}/{u['free']})"
        )

    def _repr_html_(self) -> str:
        u, st = self.cache_usage(), self.engine.state
        nbytes = (
            sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st.params)) if st.params is not None else 0
        )
        rows = {
            "model": f"{html.escape(self.model_id)} ({self.config.arch}, {self.config.num_layers} layers)",
            "weights_version": st.weights_version,
            "params": f"{nbytes / 2**20:.1f} MiB" + (" (on host)" if "weights" in st.asleep else ""),
            "asleep": ", ".join(sorted(st.asleep)) or "no",
            "KV pages": f"{u['owned']} owned · {u['cached']} cached · {u['free']} free of {u['pages']}"
            + (
                f" · sliding-window layers: {u['window_held']} held of {u['window_pages']}"
                if "window_pages" in u
                else ""
            ),
            "running / waiting": f"{self.engine.num_running()} / {self.engine.num_waiting()}",
        }
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows.items())
        return f"<table><caption>hotswap LLM</caption>{body}</table>"


def _start_engine(mcfg, params, tokenizer, args: EngineArgs, mesh: jax.sharding.Mesh | None) -> Engine:
    """The Engine `LLM` wraps: sizes the page pool (`kv_sizing.py`) and places params on the mesh,
    with the Backend chosen once, here (`catalog.Target.on`), for both the sizing and the Engine."""
    mcfg = quantize.configured(  # how the weights are served: checked before anything loads
        mcfg,
        args.quantization,
        args.quantization_group_size,
        gguf=isinstance(params, (str, Path)) and gguf_io.is_gguf(params),
        device=jax.devices()[0],
        deterministic=args.deterministic,
    ).with_kv_cache_dtype(args.kv_cache_dtype)
    max_model_len = args.max_model_len or min(mcfg.max_position_embeddings, 2048)
    tp = args.tensor_parallel_size or 1
    shardings, kv = sharding.engine_shardings(mcfg, tp, mesh)  # (None, None): 1 device
    target = catalog.Target.on(mcfg, args.attention, shardings, kv, deterministic=args.deterministic)

    def temps_at(n: int) -> int:  # on an accelerator: its largest steps, compiled for n pages
        probe = EngineConfig.of(
            args, num_pages=n, max_model_len=max_model_len, attention=target.backend.attention
        )
        return catalog.largest_temps(mcfg, probe, target)

    num_pages = kv_sizing.engine_pages(
        mcfg,
        page_size=args.page_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        num_pages=args.num_pages,
        gpu_memory_utilization=args.gpu_memory_utilization,
        devices=sorted(target.kv.device_set, key=lambda d: d.id),
        weights=catalog.weights_per_chip(mcfg, target, args.weight_update_staging),
        temps_at=temps_at,
    )
    return Engine(
        mcfg,
        params,
        EngineConfig.of(args, num_pages=num_pages, max_model_len=max_model_len),
        tokenizer,
        warmup=args.warmup,
        seed=args.seed,
        weights_root=args.weights_root,
        shardings=shardings,
        kv_sharding=target.kv,
        backend=target.backend,
    )


__all__ = ["LLM", "SamplingParams"]

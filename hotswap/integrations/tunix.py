"""HotswapRollout: hotswap as a Tunix rollout engine (`tunix.rl.rollout.base_rollout.BaseRollout`).

    from hotswap.integrations.tunix import HotswapRollout
    cluster_config = rl_cluster.ClusterConfig(rollout_engine=HotswapRollout, ...)
    # or functools.partial(HotswapRollout, page_size=32, max_num_seqs=64)

Tunix builds it as `HotswapRollout(rollout_actor=..., tokenizer=..., mesh=..., rollout_config=...)`.
The engine serves the actor's weights (Llama3, Qwen2, Qwen3), mapped by the spec table
(`weights/nnx.py`); with a mesh that has a `tp` axis it is sharded over it, otherwise
it runs on one device. Every weight sync (`update_params`) is hotswap's pure
`update_weights`: version + 1 and an empty prefix cache, so no token of a step is computed
over KV from older weights. Tunix's models use hotswap's params layout, so a state maps
leaf to leaf: leaves already on the engine's sharding are served from their own buffers
(no copy), others are resharded on their devices. A sync moves nothing to the host.

`generate` returns `RolloutOutput` shaped as Tunix's vanilla rollout returns it: `tokens`
unpadded without EOS, `left_padded_prompt_tokens` padded to `max_prompt_length` (or the
next power of two above the longest prompt), `logits` an empty list (vanilla returns no
logits unless asked, and Tunix's learners recompute log-probs), `logprobs` when
`return_logprobs` the sampled tokens' log-probs as vanilla computes them: under the raw
distribution for greedy decoding, else under the temperature-scaled one
(softmax(logits / temperature), before the top-p/top-k cut; teacher-forced on the same
version when the temperature is not 1). `get_per_token_logps` is the raw distribution's,
as vanilla's is. Sampling is
greedy when `top_p` is None (vanilla's rule) or the temperature is 0; each prompt row
gets its own seed derived from `rollout_config.seed`, so a prompt's `num_generations`
copies draw different samples.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from hotswap.engine.llm import LLM
from hotswap.engine.sampling import SamplingParams
from hotswap.errors import ConfigError, NonFiniteWeights
from hotswap.model import sharding
from hotswap.weights import lora_forms
from hotswap.weights import nnx as nnx_params
from hotswap.weights.options import UpdateOptions


def _engine_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """Tunix's devices and axes when hotswap can shard over them (a `tp` axis), else None: one
    device. The axes are Auto: the engine's model code is unannotated and GSPMD propagates."""
    if mesh is None or mesh.empty:
        return None
    try:
        sharding.tp_size(mesh)
    except ConfigError:
        return None
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _row_seed(seed: Any, row: int) -> int:
    """A 32-bit seed per prompt row from Tunix's seed (None, an int or a PRNG key)."""
    if seed is None:
        base = 0
    elif isinstance(seed, (int, np.integer)):
        base = int(seed)
    else:
        data = seed if not jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else jax.random.key_data(seed)
        base = int(np.asarray(data).ravel()[-1])
    return (base * 1_000_003 + row) & 0xFFFFFFFF


def _next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


class HotswapRollout(base_rollout.BaseRollout):
    """A Tunix rollout engine backed by a hotswap engine (paged KV, prefix cache, versioned swaps)."""

    def __init__(
        self,
        rollout_actor: nnx.Module,
        tokenizer: Any,
        mesh: jax.sharding.Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        policy: str = "drain",
        warmup: bool = False,
        lora_alpha: float | None = None,
        **engine_kwargs,
    ):
        """`engine_kwargs`: `hotswap.EngineArgs`' options, as `LLM(...)` takes them (`max_model_len`
        defaults to the rollout config's `kv_cache_size`); `warmup` is off unless asked.
        `deterministic=True`: a completion's log-probs are the same bits whatever shared its
        batch, and `get_per_token_logps` (the engine's `score`) returns them bit for bit.

        An actor that trains LoRA (qwix's `nnx.LoRAParam` leaves, as Tunix's recipes set
        `lora_config`): the engine serves its base weights with the adapter merged, scaled by
        `lora_alpha` / r (`lora_alpha` defaults to the qwix rule's alpha), and every sync
        (`update_params` of the `LoRAParam` state) merges the new adapter into the kept base."""
        self._tokenizer = (
            tokenizer
            if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
            else tokenizer_adapter.TokenizerAdapter(tokenizer)
        )
        # The actor's graph and non-Param state rebuild `model()` from the engine's weights; a
        # LoRA actor's adapter (`nnx.LoRAParam`, a Param subclass) is split out first.
        self._graphdef, self._lora, self._param_like, self._rest = nnx.split(
            rollout_actor, nnx.LoRAParam, nnx.Param, ...
        )
        # The engine starts on a copy of the actor's weights (on their devices): Tunix compares
        # `model()` with the trainer's actor once, at start, and never syncs a rollout that
        # shares its arrays; a shared start would also serve buffers the trainer donates.
        self._lora = jax.tree.map(jnp.copy, self._lora)
        own = nnx.merge(self._graphdef, self._lora, jax.tree.map(jnp.copy, self._param_like), self._rest)
        cache = rollout_config.kv_cache_size if rollout_config is not None else 1024
        engine_kwargs["max_model_len"] = engine_kwargs.get("max_model_len") or cache
        self._lora_alpha = None
        if jax.tree.leaves(self._lora):
            self._lora_alpha = (
                lora_alpha if lora_alpha is not None else nnx_params.qwix_lora_alpha(rollout_actor)
            )
        self.llm = LLM.from_flax(
            own, warmup=warmup, mesh=_engine_mesh(mesh), lora_alpha=self._lora_alpha, **engine_kwargs
        )

        self._options = UpdateOptions(policy=policy, lora_alpha=self._lora_alpha)
        self._model: tuple[int, nnx.Module] | None = None
        # One entry per generate call: (engine version at the call, set of versions of its tokens).
        self.version_log: list[tuple[int, set[int]]] = []

    # ---- views -----------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self.llm.weights_version

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self) -> nnx.Module:
        """The weights being served, as the actor's NNX module (rebuilt once per version).

        Its arrays are the engine's: at start a copy of the actor's (so Tunix's learner sees
        two copies and syncs after every step), after a sync the synced state's own arrays
        where they were already on the engine's sharding. A LoRA actor's module is the engine's
        base weights with a copy of the adapter last synced.
        """
        v = self.llm.weights_version
        if self._model is None or self._model[0] != v:
            st = self.llm.engine.state
            base = st.base if st.base is not None else st.params
            state = nnx_params.state_from_params(base, self.llm.config, self._param_like)
            self._model = (v, nnx.merge(self._graphdef, self._lora, state, self._rest))
        return self._model[1]

    # ---- generation ----------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        """As Tunix's sampler tokenizes: BOS first (once) when the tokenizer has one."""
        ids = self._tokenizer.encode(text)
        bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() else []
        return [int(t) for t in self._tokenizer.dedup_bos_ids(bos + list(ids))]

    def _sampling(self, cfg: base_rollout.RolloutConfig, row: int, eos: list[int]) -> SamplingParams:
        greedy = cfg.top_p is None or cfg.temperature == 0
        return SamplingParams(
            temperature=0.0 if greedy else float(cfg.temperature),
            top_p=1.0 if greedy else float(cfg.top_p),
            top_k=0 if greedy or not cfg.top_k else int(cfg.top_k),
            seed=_row_seed(cfg.seed, row),
            max_tokens=cfg.max_tokens_to_generate,
            stop_token_ids=eos,
        )

    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
    ) -> base_rollout.RolloutOutput:
        ids = [self._tokenize(p) for p in prompts]
        longest = max(len(x) for x in ids)
        width = rollout_config.max_prompt_length
        if width is None or width < longest:
            width = _next_power_of_2(longest)
        padded = np.full((len(ids), width), self.pad_id(), np.int32)
        for i, x in enumerate(ids):
            padded[i, width - len(x) :] = x
        eos = [int(t) for t in (rollout_config.eos_tokens or [self.eos_id()])]
        params = [self._sampling(rollout_config, i, eos) for i in range(len(ids))]
        version = self.llm.weights_version
        outs = self.llm.generate(ids, params, use_tqdm=False)
        tokens, logprobs, versions = [], [], set()
        for out in outs:
            c = out.outputs[0]
            n = len(c.token_ids) - (1 if c.token_ids and c.token_ids[-1] in eos else 0)
            tokens.append(np.asarray(c.token_ids[:n], np.int32))
            logprobs.append(list(c.logprobs[:n]))
            versions.update(c.weights_versions)
        self.version_log.append((version, versions))
        greedy = rollout_config.top_p is None or rollout_config.temperature == 0
        if rollout_config.return_logprobs and not greedy and rollout_config.temperature != 1:
            # the engine reports the raw distribution's log-probs; vanilla, the scaled one's
            pairs = [(x, t.tolist()) for x, t in zip(ids, tokens, strict=True)]
            scored = self.llm.score(pairs, temperature=float(rollout_config.temperature))
            logprobs = [lp.tolist() for lp in scored]
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens],
            logits=[],
            tokens=tokens,
            left_padded_prompt_tokens=padded,
            logprobs=logprobs if rollout_config.return_logprobs else None,
        )

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """Teacher-forced log-probs `[B, completion_len]` of each completion under the served
        version; pad positions (right padding) are 0, as Tunix masks them."""
        prompts, comps = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad = self.pad_id()
        pairs = []
        for p, c in zip(prompts, comps, strict=True):
            keep = c != pad
            n = int(np.argmin(keep)) if not keep.all() else len(c)  # right-padded: the first pad ends it
            pairs.append((p[p != pad].tolist(), c[:n].tolist()))
        out = np.zeros(comps.shape, np.float32)
        for i, lp in enumerate(self.llm.score(pairs)):
            out[i, : len(lp)] = lp
        return jnp.asarray(out)

    # ---- weights ----------------------------------------------------------------

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Swap in the trainer's NNX state: a pure `update_weights` (version + 1, empty cache).

        A state of `nnx.LoRAParam` leaves only (Tunix's sync of a LoRA actor) is an adapter:
        merged on the device into the base weights the engine keeps, scaled by `lora_alpha` / r.
        A bad state (another family or size, a missing layer, NaN, a LoRA factor of the wrong
        shape) raises a typed error naming the parameter, and the old version keeps serving.
        """
        adapter = lora_forms.is_nnx_lora(params)
        try:
            self.llm.update_weights(params, self._options)  # read by NNX names, cast, placed
        except NonFiniteWeights as e:  # the engine names its params leaf; add the NNX path
            if adapter:
                raise
            leaf, _, rest = str(e).partition(":")
            name = nnx_params.nnx_name(self.llm.config, leaf) or leaf
            raise NonFiniteWeights(f"{name} (params {leaf}):{rest}") from e
        if adapter and self._lora is not None:
            self._lora = nnx.State(jax.tree.map(jnp.copy, params))

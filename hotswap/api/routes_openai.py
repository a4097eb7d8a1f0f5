"""OpenAI routes: /v1/completions and /v1/chat/completions, plain JSON or SSE streams.

Every response and every stream chunk carries a top-level `weights_version`;
a choice whose tokens came from more than one version carries
`weights_version_spans`. A stream always ends with `data: [DONE]`; an error
after the first byte is sent as an error event first, never as a silent cut.
A client that disconnects has its engine request aborted. The stream and the collector are
api/streaming.py's, which SGLang's `/generate` uses too; what is here is OpenAI's chunk shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hotswap.api import prompt_fields, streaming
from hotswap.api.engine_loop import ServerContext, ctx_of, require_api_key
from hotswap.api.http_errors import EngineAsleep, PromptTooLong
from hotswap.api.kept_fields import kept_json
from hotswap.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    response_version,
    token_str,
    unsupported,
    usage,
    version_fields,
)
from hotswap.api.request_ids import client_id
from hotswap.api.version_labels import wire_version_fields
from hotswap.engine.chat import chat_prompt
from hotswap.engine.outputs import CompletionOutput, RequestOutput
from hotswap.engine.sampling import SamplingParams
from hotswap.toolcalls.choice import ToolChoice
from hotswap.toolcalls.parsers import Delta, ToolStream, collect

router = APIRouter(dependencies=[Depends(require_api_key)])


def _check_length(ctx: ServerContext, prompt_ids: list[int], max_tokens: int | None) -> None:
    """vLLM's rule: the prompt plus max_tokens must fit max_model_len (the engine checks the prompt)."""
    mml = ctx.engine.ecfg.max_model_len
    if len(prompt_ids) >= mml or (max_tokens is not None and len(prompt_ids) + max_tokens > mml):
        raise PromptTooLong(
            f"this model's maximum context length is {mml} tokens, but the request has {len(prompt_ids)} "
            f"prompt tokens and max_tokens={max_tokens}; shorten the prompt or lower max_tokens"
        )


async def _start(
    ctx: ServerContext,
    prompts: list[list[int]],
    sp: SamplingParams,
    stream: bool,
    lora_name: str | None,
    engine_ids: list[tuple[str, tuple[str, ...]]],
) -> tuple[asyncio.Queue, list[str]]:
    """Queue one engine request per prompt (served with the LoRA adapter `lora_name`, or the
    base); all outputs arrive on one asyncio queue. `engine_ids[i]`: prompt i's engine request id and
    the other ids a client may abort it by (api/request_ids.py)."""
    ctx.check_admitting()
    if not ctx.engine.state.serving:  # the engine re-checks under its lock; this one speaks REST
        raise EngineAsleep(
            f"the engine is asleep ({', '.join(sorted(ctx.engine.state.asleep))}): POST /wakeup first "
            "(after /sleep?level=2: /wakeup?tags=weights, /update_weights, then /wakeup?tags=kv_cache)"
        )
    for ids in prompts:
        _check_length(ctx, ids, sp.max_tokens)
    queue: asyncio.Queue = asyncio.Queue()
    rids: list[str] = []
    try:
        for prompt, (rid, names) in zip(prompts, engine_ids, strict=True):
            rids.append(await ctx.submit(prompt, sp, stream, queue, lora_name, rid, names))
    except BaseException:
        for rid in rids:  # a later prompt was refused (e.g. queue full): drop the earlier ones too
            ctx.loop.abort(rid)
        raise
    return queue, rids


def _chunk_version(out: RequestOutput, comp: CompletionOutput) -> int:
    return comp.weights_versions[-1] if comp.weights_versions else out.weights_version


def _choice_chunks(
    rids: list[str],
    sp: SamplingParams,
    choice: Callable[[int, CompletionOutput, str, int, int], dict | None],
    wrap: Callable[[list[dict], int], dict],
) -> streaming.Render:
    """One chunk per choice that has new text, for all prompts x n choices;
    `choice(index, comp, text_delta, first_new_token, text_offset)`, None for no chunk yet (a
    tool-call reader holds the text back; its tokens go with the next one).

    The text of a chunk is the engine's `text_delta` (engine/outputs.py holds back what a
    stop string could still cut and partial characters), so the chunks add up to the text."""
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done_choices: set[int] = set()
    prompt_index = {rid: i for i, rid in enumerate(rids)}

    def render(item: RequestOutput) -> list[dict]:
        chunks = []
        for comp in item.outputs:
            ci = prompt_index[item.request_id] * sp.n + comp.index
            if ci in done_choices:
                continue
            text = comp.text_delta
            if not text and comp.finish_reason is None:
                continue  # held back (partial character or stop-string prefix)
            start, offset = sent_tokens.get(ci, 0), sent_chars.get(ci, 0)
            body = choice(ci, comp, text, start, offset)
            if body is None:
                continue
            sent_tokens[ci] = len(comp.token_ids)
            sent_chars[ci] = offset + len(text)
            if comp.finish_reason is not None:
                done_choices.add(ci)
            chunks.append(wrap([body], _chunk_version(item, comp)))
        return chunks

    return render


def _usage_tail(include: bool, wrap: Callable[[list[dict], int], dict]):
    """`stream_options.include_usage`: a last chunk with no choices and the usage."""
    if not include:
        return None
    return lambda outs: [{**wrap([], response_version(outs)), "usage": usage(outs)}]


def routed(c: CompletionOutput) -> dict:
    """vLLM's `routed_experts` (`--enable-return-routed-experts`): the experts each input token
    went to, [prompt + generated - 1][moe layers][k], on a finished choice."""
    return {} if c.routed_experts is None else {"routed_experts": c.routed_experts.tolist()}


# --------------------------------------------------------------------------- /v1/completions


def _no_tokens(c: CompletionOutput) -> CompletionOutput:
    """A choice with its generated tokens hidden: echo with max_tokens 0 shows the prompt alone."""
    top = None if c.top_logprobs is None else []
    hidden = {f: [] for f in ("kept_counts", "kept_token_ids", "kept_masks") if getattr(c, f) is not None}
    return dataclasses.replace(
        c, text="", token_ids=[], logprobs=[], top_logprobs=top, text_delta="", **hidden
    )


def _keeping_prompt_logprobs(rids: list[str], plps: dict, render: streaming.Render) -> streaming.Render:
    """`render`, after noting each output's prompt log-probs (by prompt index) for its choices."""
    index = {rid: i for i, rid in enumerate(rids)}

    def keep(item: RequestOutput) -> list[dict]:
        if item.prompt_logprobs is not None:
            plps[index[item.request_id]] = item.prompt_logprobs
        return render(item)

    return keep


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = ctx_of(request)
    lora_name = ctx.check_model(body.model)
    sp = body.sampling_params()
    tok = ctx.engine.tokenizer
    prompts = [ctx.engine.tokenize(p) for p in body.prompts()]
    echo = [
        (text if text is not None else tok.decode(ids)) if body.echo and tok else "" for text, ids in prompts
    ]
    client = client_id(request, body.request_id)
    cid, created = f"cmpl-{client.base}", int(time.time())
    # Prompt i runs as `<id>-<i>` (vLLM's ids); the response's id names them all.
    engine_ids = [(f"{cid}-{i}", client.names(cid)) for i in range(len(prompts))]
    queue, rids = await _start(ctx, [ids for _, ids in prompts], sp, body.stream, lora_name, engine_ids)
    wire = wire_version_fields(ctx, request.url.path)

    def wrap(choices: list[dict], version: int) -> dict:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
            "weights_version": version,
        }

    as_ids = body.return_tokens_as_token_ids
    echo_lps = body.echo and body.logprobs is not None  # the prompt's log-probs lead the choice's
    plps: dict[int, list | None] = {}  # prompt index -> its RequestOutput.prompt_logprobs

    def choice(ci: int, comp: CompletionOutput, text: str, start: int, offset: int = 0) -> dict:
        p = ci // sp.n
        if body.prompt_only:  # the one generated token is not shown
            comp, text = _no_tokens(comp), ""
        # The echoed prompt goes with a choice's first tokens; a plain stream sent it ahead (head).
        lead = echo[p] if start == 0 and (echo_lps or not body.stream) else ""
        lp = None
        if body.logprobs is not None:
            # the generated text's offsets follow the echoed prompt
            shift = len(echo[p]) if echo_lps or not body.stream else 0
            lp = completion_logprobs(tok, comp, start, offset + shift, as_ids)
            if echo_lps and start == 0 and plps.get(p) is not None:
                lp = prompt_fields.echo_logprobs(
                    prompts[p][1], plps[p], body.logprobs, partial(token_str, tok, as_ids=as_ids), lp
                )
        out = {"index": ci, "text": lead + text, "logprobs": lp, "finish_reason": comp.finish_reason}
        out.update(kept_json(comp, start))
        if body.prompt_logprobs is not None and start == 0:
            out["prompt_logprobs"] = prompt_fields.vllm_json(plps.get(p))
        if body.return_token_ids:  # a stream sends the prompt's ids with a choice's first tokens
            if start == 0:
                out["prompt_token_ids"] = prompts[ci // sp.n][1]
            out["token_ids"] = comp.token_ids[start:]
        if comp.finish_reason is not None:
            out.update(stop_reason=comp.stop_reason, **version_fields(comp), **wire(comp), **routed(comp))
        return out

    if body.stream:
        n = sp.n
        head = [
            wrap(
                [{"index": p * n + i, "text": e, "logprobs": None, "finish_reason": None}],
                ctx.engine.weights_version,
            )
            for p, e in enumerate(echo)
            if e and not echo_lps  # echo + logprobs: with the first tokens, once their log-probs are in
            for i in range(n)
        ]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        render = _keeping_prompt_logprobs(rids, plps, _choice_chunks(rids, sp, choice, wrap))
        tail = _usage_tail(include_usage, wrap)
        return streaming.stream(streaming.events(ctx, request, queue, rids, render, head=head, tail=tail))

    outs = await streaming.collect(ctx, request, queue, rids)
    if outs is None:
        return streaming.gone()
    plps.update((p, o.prompt_logprobs) for p, o in enumerate(outs))
    choices = [choice(p * sp.n + c.index, c, c.text, 0) for p, o in enumerate(outs) for c in o.outputs]
    return JSONResponse({**wrap(choices, response_version(outs)), "usage": usage(outs)})


# --------------------------------------------------------------------------- /v1/chat/completions


def _finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's `tool_calls` for an output that ended by itself with calls made."""
    return "tool_calls" if calls and reason == "stop" else reason


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = ctx_of(request)
    lora_name = ctx.check_model(body.model)
    tools, fmt = ToolChoice.of(body.tools, body.tool_choice, body.parallel_tool_calls), ctx.tool_format
    sp = body.sampling_params()
    if overrides := tools.sampling_overrides(fmt, sp.structured_outputs is not None):
        sp = dataclasses.replace(sp, **overrides)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise unsupported("messages", "this model has no tokenizer; use /v1/completions with token ids")
    _, ids = chat_prompt(
        tok,
        [m.model_dump(exclude_none=True) for m in body.messages],
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=tools.offered,
        tool_format=fmt,
    )
    client = client_id(request, body.request_id)
    cid, created = f"chatcmpl-{client.base}", int(time.time())
    queue, rids = await _start(ctx, [ids], sp, body.stream, lora_name, [(cid, client.names(cid))])
    kind = "chat.completion.chunk" if body.stream else "chat.completion"
    wire = wire_version_fields(ctx, request.url.path)

    def wrap(choices: list[dict], version: int) -> dict:
        return {
            "id": cid,
            "object": kind,
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
            "weights_version": version,
        }

    def logprobs(comp: CompletionOutput, start: int) -> dict | None:
        return chat_logprobs(tok, comp, start, body.return_tokens_as_token_ids) if body.logprobs else None

    def token_ids(comp: CompletionOutput, start: int) -> dict:
        return {"token_ids": comp.token_ids[start:]} if body.return_token_ids else {}

    prompt_ids = {"prompt_token_ids": ids} if body.return_token_ids else {}
    readers: dict[int, ToolStream | None] = {}  # per choice: its tool-call reader (None: no tools)

    def delta_choice(ci: int, comp: CompletionOutput, text: str, start: int, _offset: int = 0) -> dict | None:
        delta: dict[str, Any] = {"content": text}
        reason = comp.finish_reason
        if ci not in readers:
            readers[ci] = tools.stream(fmt)
        reader = readers[ci]
        if reader is not None:
            read = reader.feed(text) + (reader.flush() if reason is not None else Delta())
            if not read and reason is None:
                return None
            delta = {"content": read.content} if read.content else {}
            if read.tool_calls:
                delta["tool_calls"] = [t.to_openai() for t in read.tool_calls]
            reason = _finish_reason(reason, reader.calls)
        out = {"index": ci, "delta": delta, "logprobs": logprobs(comp, start)}
        out.update(token_ids(comp, start), **kept_json(comp, start), finish_reason=reason)
        if comp.finish_reason is not None:
            out.update(stop_reason=comp.stop_reason, **version_fields(comp), **wire(comp))
        return out

    if body.stream:
        # The role comes first, once per choice, as OpenAI sends it.
        head = [
            {
                **wrap(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    ctx.engine.weights_version,
                ),
                **prompt_ids,
            }
            for i in range(sp.n)
        ]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        render = _choice_chunks(rids, sp, delta_choice, wrap)
        tail = _usage_tail(include_usage, wrap)
        return streaming.stream(streaming.events(ctx, request, queue, rids, render, head=head, tail=tail))

    outs = await streaming.collect(ctx, request, queue, rids)
    if outs is None:
        return streaming.gone()

    def message_choice(c: CompletionOutput) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason, reader = c.finish_reason, tools.stream(fmt)
        if reader is not None:
            message["content"], calls = collect(reader, c.text)
            if calls:
                message["tool_calls"] = [t.to_openai() for t in calls]
            reason = _finish_reason(reason, len(calls))
        return {
            "index": c.index,
            "message": message,
            "logprobs": logprobs(c, 0),
            **token_ids(c, 0),
            **kept_json(c),
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
            **version_fields(c),
            **wire(c),
            **routed(c),
        }

    choices = [message_choice(c) for c in outs[0].outputs]
    # vLLM's: the prompt's log-probs once, beside the choices
    plp = (
        {}
        if body.prompt_logprobs is None
        else {"prompt_logprobs": prompt_fields.vllm_json(outs[0].prompt_logprobs)}
    )
    return JSONResponse({**wrap(choices, response_version(outs)), **prompt_ids, **plp, "usage": usage(outs)})

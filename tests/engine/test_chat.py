"""`LLM.chat` (vLLM's signature) and the server's chat route: one template path (engine/chat.py).

`chat_llm` is parametrized over model fixtures: each entry of `CHAT_MODELS` names a fixture
that returns something `LLM(...)` loads and whose tokenizer has a chat template. The tiny
seeded checkpoint carries `create.CHAT_TEMPLATE` (ChatML-style).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hotswap.api.server import create_app
from hotswap.checkpoint.create import CHAT_TEMPLATE
from hotswap.engine.chat import chat_prompt
from hotswap.engine.llm import LLM, SamplingParams
from hotswap.errors import RequestError

CHAT_MODELS = ["tiny_dir", "smollm2_gguf"]  # fixture names: the seeded checkpoint and a real chat model
KW = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, page_size=16, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

CONV = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me about the robot."},
]
CONV_2 = [
    {"role": "user", "content": "What is the weather tomorrow?"},
    {"role": "assistant", "content": "Cloudy."},
    {"role": "user", "content": [{"type": "text", "text": "And the "}, {"type": "text", "text": "wind?"}]},
]
CONV_2_TEXT = [*CONV_2[:2], {"role": "user", "content": "And the wind?"}]  # as the template sees it
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ tail }}"


@pytest.fixture(scope="module", params=CHAT_MODELS)
def chat_llm(request):
    return LLM(request.getfixturevalue(request.param), **KW)


def _ids(llm: LLM, conv, **kw) -> list[int]:
    return llm.tokenizer.apply_chat_template(conv, tokenize=True, **kw)


def _same(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]


def test_chat_equals_generate_on_template_ids(chat_llm):
    (out,) = chat_llm.chat(CONV, GREEDY, use_tqdm=False)
    ids = _ids(chat_llm, CONV)
    (ref,) = chat_llm.generate([ids], GREEDY, use_tqdm=False)
    _same(out, ref)
    assert out.prompt == chat_llm.tokenizer.apply_chat_template(CONV)  # the rendered text
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_chat_batch_equals_generate(chat_llm):
    outs = chat_llm.chat(
        [CONV, CONV_2], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3)], use_tqdm=False
    )
    refs = chat_llm.generate(
        [_ids(chat_llm, CONV), _ids(chat_llm, CONV_2_TEXT)],
        [GREEDY, SamplingParams(temperature=0.0, max_tokens=3)],
        use_tqdm=False,
    )
    assert len(outs) == 2
    for out, ref in zip(outs, refs, strict=True):
        _same(out, ref)


def test_chat_template_override_and_kwargs(chat_llm):
    (out,) = chat_llm.chat(
        CONV,
        GREEDY,
        use_tqdm=False,
        chat_template=PLAIN_TEMPLATE,
        chat_template_kwargs={"tail": "assistant:"},
    )
    text = "system: You are brief.\nuser: Tell me about the robot.\nassistant:"
    assert out.prompt == text
    tok = chat_llm.tokenizer
    (ref,) = chat_llm.generate([tok.encode(text, add_special_tokens=False)], GREEDY, use_tqdm=False)
    _same(out, ref)


def test_continue_final_message(chat_llm):
    conv = [*CONV, {"role": "assistant", "content": "The robot counted"}]
    (out,) = chat_llm.chat(
        conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt.endswith("The robot counted")
    full = chat_llm.tokenizer.apply_chat_template(conv, add_generation_prompt=False)
    assert full.startswith(out.prompt) and len(full) > len(out.prompt)  # the end-of-turn is cut
    ids = _ids(chat_llm, conv, add_generation_prompt=False, continue_final_message=True)
    _same(out, chat_llm.generate([ids], GREEDY, use_tqdm=False)[0])
    with pytest.raises(RequestError, match="cannot both be true"):
        chat_llm.chat(conv, GREEDY, use_tqdm=False, continue_final_message=True)


def test_add_generation_prompt_false(chat_llm):
    (out,) = chat_llm.chat(CONV, GREEDY, use_tqdm=False, add_generation_prompt=False)
    with_prompt = chat_llm.tokenizer.apply_chat_template(CONV)
    assert with_prompt.startswith(out.prompt) and with_prompt != out.prompt
    _same(
        out, chat_llm.generate([_ids(chat_llm, CONV, add_generation_prompt=False)], GREEDY, use_tqdm=False)[0]
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "expected a conversation"),
        ([], "expected a conversation"),
        ([{"role": "user", "content": "x"}, "y"], "expected a conversation"),
        ([[{"content": "x"}]], r"messages\[0\].role: expected a non-empty string"),
        ([[{"role": "user", "content": 3}]], r"messages\[0\].content: expected a string"),
        (
            [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]],
            r"messages\[0\].content\[0\]: only .* parts are supported, got 'image_url'",
        ),
        ([[]], "non-empty list of messages"),
    ],
)
def test_bad_conversations_are_request_errors(chat_llm, messages, match):
    with pytest.raises(RequestError, match=match):
        chat_llm.chat(messages, GREEDY, use_tqdm=False)


def test_a_templates_own_check_is_a_request_error(tiny_dir):
    """The tiny checkpoint's template refuses roles it does not know (ChatML templates such as
    SmolLM2's accept any role, so this is the tiny model's case only)."""
    with pytest.raises(RequestError, match="unknown role: robot"):
        LLM(tiny_dir, **KW).chat([[{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)


def test_bad_template_options_are_request_errors(chat_llm):
    with pytest.raises(RequestError, match="chat_template: syntax error"):
        chat_llm.chat(CONV, use_tqdm=False, chat_template="{% for %}")
    with pytest.raises(RequestError, match="set by the chat"):
        chat_llm.chat(CONV, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_server_route_uses_the_same_prompt_ids(chat_llm, monkeypatch):
    """POST /v1/chat/completions and LLM.chat queue the same prompt ids for the same messages and options."""
    engine = chat_llm.engine
    seen: list[list[int]] = []
    add = engine.add_request
    monkeypatch.setattr(
        engine, "add_request", lambda rid, prompt, *a, **k: seen.append(prompt) or add(rid, prompt, *a, **k)
    )
    cont = [*CONV_2, {"role": "assistant", "content": "Light"}]
    cases = [
        (CONV, {}),
        (CONV_2, {"add_generation_prompt": False}),
        (cont, {"add_generation_prompt": False, "continue_final_message": True}),
        (CONV, {"chat_template_kwargs": {"bos_token": ""}}),
    ]
    body = {"model": "m", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with TestClient(create_app(engine, model_name="m")) as http:  # its engine loop steps `engine`
        replies = []
        for conv, opts in cases:
            r = http.post("/v1/chat/completions", json={**body, "messages": conv, **opts})
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["message"]["content"])
        r = http.post("/v1/chat/completions", json={"messages": cont, "continue_final_message": True})
        assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]
    server_prompts = list(seen)
    assert len(server_prompts) == len(cases)
    for (conv, opts), prompt, reply in zip(cases, server_prompts, replies, strict=True):
        (out,) = chat_llm.chat(conv, GREEDY, use_tqdm=False, **opts)  # after the server loop stopped
        assert prompt == out.prompt_token_ids == chat_prompt(chat_llm.tokenizer, conv, **opts)[1]
        assert reply == out.outputs[0].text


def test_tiny_template_matches_transformers(tiny_dir):
    """continue_final_message, add_generation_prompt and template kwargs render as transformers renders them."""
    from transformers import AutoTokenizer

    from hotswap.checkpoint.tokenizer import Tokenizer

    tok, hf = Tokenizer.from_dir(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    conv = [*CONV, {"role": "assistant", "content": "The robot counted "}]  # trailing space: kept
    for opts in (
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False},
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "chat_template": PLAIN_TEMPLATE, "tail": "X"},
    ):
        assert tok.apply_chat_template(conv, **opts) == hf.apply_chat_template(conv, tokenize=False, **opts)

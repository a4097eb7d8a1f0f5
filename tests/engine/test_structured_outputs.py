"""Constrained decoding in the engine (engine/structured.py, the sampler's masks), on the tiny
seeded model: the constraint holds with sampling, n, logprobs, stop strings, prefix hits, an
update mid-request (recompute and keep) and a pause; unconstrained rows beside constrained
ones draw what they draw alone; bad constraints are refused before anything is queued."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hotswap import LLM, SamplingParams, StructuredOutputs
from hotswap.checkpoint import hf
from hotswap.errors import RequestError

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)
PATTERN = r"[a-z]{2,6}(-[0-9]{1,3}){1,3}"
CODE = StructuredOutputs(regex=PATTERN)
PROMPT = list(range(20, 70))  # 50 tokens: 3 full pages


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **KW)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_sampled_n_samples_match_and_report_raw_logprobs(llm):
    sp = SamplingParams(
        n=3, temperature=1.0, top_p=0.9, seed=5, max_tokens=40, logprobs=2, structured_outputs=CODE
    )
    out = _gen(llm, [PROMPT], sp)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(PATTERN, c.text), c.text
        # The log-probs are the raw model distribution's, as `score` gives them.
        np.testing.assert_allclose(c.logprobs, llm.score(PROMPT, c.token_ids), atol=1e-5)
        assert len(c.top_logprobs) == len(c.token_ids)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # n samples, not one copied


def test_unconstrained_rows_draw_the_same_tokens_beside_constrained_ones(llm):
    free = [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _gen(llm, [PROMPT[3:], PROMPT[5:], PROMPT[7:]], [*free, greedy])
    constrained = SamplingParams(temperature=1.0, seed=9, max_tokens=30, structured_outputs=CODE)
    mixed = _gen(
        llm,
        [PROMPT[3:], PROMPT[1:], PROMPT[5:], PROMPT[2:], PROMPT[7:]],
        [free[0], constrained, free[1], constrained, greedy],
    )
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2], mixed[4])] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert all(re.fullmatch(PATTERN, o.outputs[0].text) for o in (mixed[1], mixed[3]))


def test_greedy_constrained_is_the_masked_argmax(llm):
    """Greedy under a choice picks, token by token, the likeliest allowed continuation."""
    choices = ["alpha", "beta", "gamma"]
    out = _gen(
        llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"choice": choices})
    )
    c = out[0].outputs[0]
    assert c.text in choices and c.finish_reason == "stop"
    tok = llm.engine.tokenizer
    # Any token that spells a prefix of a choice may start it ("a" + "lpha" as well as "alpha").
    starts = [
        t for t in range(tok.vocab_size) if (p := tok.decode([t])) and any(ch.startswith(p) for ch in choices)
    ]
    lps = {t: llm.score(PROMPT, [t])[0] for t in starts}
    assert c.token_ids[0] == max(lps, key=lps.get)


def test_stop_strings_and_prefix_hits_keep_the_constraint(llm):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=CODE, stop=["-"])
    first = _gen(llm, [PROMPT], sp)[0].outputs[0]
    assert (
        first.finish_reason == "stop" and first.stop_reason == "-" and re.fullmatch("[a-z]{2,6}", first.text)
    )
    again = _gen(
        llm, [PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=CODE)
    )[0]
    assert again.num_cached_tokens == 48 and re.fullmatch(PATTERN, again.outputs[0].text)


def test_unsatisfiable_within_max_tokens_ends_by_length(llm):
    out = _gen(
        llm,
        [PROMPT],
        SamplingParams(temperature=1.0, seed=0, max_tokens=4, structured_outputs={"regex": "[a-z]{60}"}),
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and re.fullmatch("[a-z]*", c.text)


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_an_update_mid_request_keeps_the_constraint(tiny_dir, tiny_dir_b, policy):
    llm = LLM(tiny_dir, **KW)
    long = StructuredOutputs(regex=r"[a-z]{20,30}")
    got = {}
    for i in range(3):
        sp = SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=long)
        llm.engine.add_request(f"r{i}", PROMPT[i:], sp, sink=lambda o: got.__setitem__(o.request_id, o))
    for _ in range(8):  # prompts prefilled and some letters drawn under version 1
        llm.engine.step()
    assert all(len(s.output_ids) > 0 for r in llm.engine.requests.values() for s in r.seqs)
    llm.update_weights(hf.load_hf_dir(tiny_dir_b)[1], policy=policy)
    while llm.engine.has_unfinished():
        llm.engine.step()
    for i in range(3):
        c = got[f"r{i}"].outputs[0]
        assert re.fullmatch(r"[a-z]{20,30}", c.text), (policy, c.text)
        assert set(c.weights_versions) == {1, 2}


def test_a_pause_keeps_the_constraint(tiny_dir):
    llm = LLM(tiny_dir, **KW)
    got = {}
    sp = SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs={"regex": r"[a-z]{20,30}"})
    llm.engine.add_request("p", PROMPT, sp, sink=lambda o: got.__setitem__(o.request_id, o))
    for _ in range(6):
        llm.engine.step()
    llm.engine.pause("retract")  # sequences back to the queue, their tokens kept
    llm.engine.resume()
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert re.fullmatch(r"[a-z]{20,30}", got["p"].outputs[0].text)


@pytest.mark.parametrize(
    "so, field",
    [
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"json": {"type": "strnig"}}, "structured_outputs.json"),
        ({"grammar": "start: missing"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": "yes"}, "structured_outputs.choice"),
        ({"json": {}, "whitespace_pattern": 5}, "structured_outputs.whitespace_pattern"),
        ({"structural_tag": {"structures": [1]}}, "structured_outputs.structural_tag"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ({"jsn": {}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_refused_before_anything_is_queued(llm, so, field):
    with pytest.raises(RequestError, match=re.escape(field)) as e:
        llm.engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=so))
    assert e.value.param == field
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished()


def test_a_repeated_constraint_compiles_once(llm):
    so = StructuredOutputs(json={"type": "object", "properties": {"k": {"enum": ["v", "w"]}}})
    llm.engine.add_request("c1", PROMPT, SamplingParams(max_tokens=2, structured_outputs=so))
    compiled = len(llm.engine.grammars)
    llm.engine.add_request(
        "c2", PROMPT, SamplingParams(max_tokens=2, n=2, structured_outputs=dict(json=so.json))
    )
    assert len(llm.engine.grammars) == compiled  # the same constraint: no new entry
    llm.engine.abort("c1")
    llm.engine.abort("c2")


def test_structural_tag_constrains_only_inside_its_tags(llm):
    """vLLM's structural_tag: free text, and after a trigger the tag's schema then its end."""
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f=add>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "end": "</f>",
            }
        ],
        "triggers": ["<f="],
    }
    tok = llm.engine.tokenizer
    llm.engine.add_request(
        "t", PROMPT, SamplingParams(max_tokens=2, structured_outputs={"structural_tag": tag})
    )
    llm.engine.abort("t")
    grammars = llm.engine.grammars

    def accepts(text: str) -> bool:
        m = grammars.matcher(StructuredOutputs(structural_tag=tag))
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids)

    assert accepts('any text <f=add>{"a": 3}</f> and more')
    assert not accepts('text <f=add>{"a": "three"}</f>')  # not the schema inside the tag


def test_the_engine_option_reaches_the_compiler(llm, tiny_dir):
    """`structured_outputs_strict_mode` (on by default) decides how every schema compiles."""
    so = StructuredOutputs(json={"type": "object", "properties": {"k": {"enum": ["v"]}}})
    extra = '{"k": "v", "other": 1}'

    def admits(engine) -> bool:
        engine.add_request("s", PROMPT, SamplingParams(max_tokens=2, structured_outputs=so))
        engine.abort("s")
        matcher, ids = engine.grammars.matcher(so), engine.tokenizer.encode(extra, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert llm.engine.grammars is None or llm.engine.grammars.strict_mode
    assert not admits(llm.engine)
    opened = LLM(tiny_dir, **KW, warmup=False, structured_outputs_strict_mode=False)
    assert admits(opened.engine)

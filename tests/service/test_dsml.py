"""DeepSeek-V4 prompts and DSML tool calls against DeepSeek's reference implementation, the `deepseek-recipe`
package (PyPI): its V4 prompt renderer and its Chat Completions output parser are the oracle."""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as recipe
import pytest

from dsv4_serve.service.api.encoding import REASONING_EFFORT_MAX, encode_messages
from dsv4_serve.service.api.tool_stream import ToolStream
from dsv4_serve.service.api.tools import parse_completion

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "description": "Web search, ünïcode", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}},
}
NOARGS = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Weather in Paris and Rome?"}
A_CALLS = {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
           "tool_calls": [call("c1", "get_weather", {"city": "Paris", "days": 2}),
                          call("c2", "get_weather", {"city": "Rome"})]}
T1 = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
T2 = {"role": "tool", "tool_call_id": "c2",
      "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "wind"}]}

# (messages, tools, thinking, reasoning_effort)
CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool, str | None]] = [
    ([U1], None, False, None),
    ([SYS, U1], [WEATHER], False, None),
    ([U1], [WEATHER, SEARCH, NOARGS], True, None),
    ([SYS, U1, A_CALLS, T1, T2], [WEATHER], False, None),
    ([SYS, U1, A_CALLS, T2, T1], [WEATHER], True, None),  # results sorted back into call order
    ([SYS, U1, A_CALLS, T1, T2, {"role": "assistant", "content": "Sunny, then rain.",
                                 "reasoning_content": "Summarise."}, {"role": "user", "content": "Thanks"}],
     [WEATHER], True, "max"),
    ([SYS, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r1"},
      {"role": "user", "content": "again"}], None, True, None),  # no tools: earlier reasoning dropped
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, False, None),  # one user turn
    ([{"role": "developer", "content": "dev rules"}, U1, {"role": "assistant", "content": "x"},
      {"role": "developer", "content": "later rules"}], None, True, "high"),
    ([U1, {"role": "assistant", "content": None, "tool_calls": [call("n1", "now", {})]},
      {"role": "tool", "tool_call_id": "n1", "content": "12:00"}, {"role": "user", "content": "and now?"}],
     [NOARGS], False, None),
    ([U1, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("s1", "search", {"q": "a \"quoted\" query", "filters": {"lang": ["en", "fr"], "n": 3}})]},
      {"role": "tool", "tool_call_id": "s1", "content": "{\"hits\": 0}"}], [SEARCH], True, None),
    ([SYS, U1, A_CALLS, T1, T2], None, True, "max"),  # tool history without tools declared
]
DEVELOPER = 8  # the case the reference cannot render


def ref_request(messages: list[dict[str, Any]], tools: Any, thinking: bool, effort: str | None) -> Any:
    body: dict[str, Any] = {"model": "DeepSeek-V4-Pro", "messages": messages,
                            "thinking": {"type": "enabled" if thinking else "disabled"}}  # fmt: skip
    if tools:
        body["tools"] = tools
    if effort:
        body["reasoning_effort"] = effort
    return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())


def recipe_prompt(messages: list[dict[str, Any]], tools: Any, thinking: bool, effort: str | None) -> str:
    conversation = ref_request(messages, tools, thinking, effort).conversation
    return recipe.DeepseekV4Encoding().render_conversation(conversation).prompt


def ref_prompt(messages: list[dict[str, Any]], tools: Any, thinking: bool, effort: str | None) -> str:
    """The reference's prompt with its effort paragraph (the text between BOS and the first turn of a bare
    prompt at this level) put back to the V4-Flash release's: REASONING_EFFORT_MAX for "max" in thinking mode,
    none otherwise (deepseek-recipe renders V4 Pro's policy: see service/api/encoding.py)."""
    bare = recipe_prompt([{"role": "user", "content": "u"}], None, thinking, effort)
    theirs = bare[len(BOS) : bare.index(USER)]
    ours = REASONING_EFFORT_MAX if thinking and effort == "max" else ""
    prompt = recipe_prompt(messages, tools, thinking, effort)
    assert prompt.startswith(BOS + theirs)
    return BOS + ours + prompt[len(BOS) + len(theirs) :]


@pytest.mark.parametrize("case", [i for i in range(len(CASES)) if i != DEVELOPER])
def test_prompt_equals_reference(case: int) -> None:
    messages, tools, thinking, effort = CASES[case]
    ours = encode_messages(messages, tools=tools, thinking=thinking, reasoning_effort=effort)
    assert ours == ref_prompt(messages, tools, thinking, effort)


def test_reasoning_effort_levels_equal_reference() -> None:
    msgs = [SYS, U1]
    for effort in (None, "low", "high", "xhigh", "max"):
        for thinking in (True, False):
            got = encode_messages(msgs, thinking=thinking, reasoning_effort=effort)
            assert got == ref_prompt(msgs, None, thinking, effort), (effort, thinking)


def test_developer_turns() -> None:
    """The reference has no developer role (it rejects one); ours follows the release's encoder: a developer
    turn is a user turn, and in thinking mode those before the last user turn are dropped."""
    messages, tools, thinking, effort = CASES[DEVELOPER]
    with pytest.raises(ValueError, match="unknown variant `developer`"):
        ref_prompt(messages, tools, thinking, effort)
    effort_text = REASONING_EFFORT_MAX if effort == "max" else ""
    want = (f"{BOS}{effort_text}{USER}Weather in Paris and Rome?{ASSISTANT}{END_THINK}x{EOS}"
            f"{USER}later rules{ASSISTANT}{THINK}")  # fmt: skip
    assert encode_messages(messages, tools=tools, thinking=thinking, reasoning_effort=effort) == want


def ref_assistant_text(m: dict[str, Any]) -> str:
    """An assistant turn as the reference renders it (chat mode): a completion text, EOS excluded."""
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "r"} for c in m.get("tool_calls") or ()]
    prompt = ref_prompt([{"role": "user", "content": "q"}, m, *results], None, False, None)
    return prompt.split(ASSISTANT + END_THINK, 1)[1].split(EOS, 1)[0]


def ref_parse(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """The reference's Chat Completions parser over a completion: (content, [(name, arguments)])."""
    req = ref_request([{"role": "user", "content": "q"}], [WEATHER, SEARCH, NOARGS], False, None)
    proc = recipe.StreamProcessor(recipe.ChatCompletionRequest.chunk_generator(req, "id", "m"), req.parsing_options)
    chunks = proc.push(recipe.InferenceChunk.ready())
    for i in range(0, len(text), 7):
        chunks += proc.push(recipe.InferenceChunk.text(text[i : i + 7], 1))
    chunks += proc.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop)) + proc.finish()
    resp = recipe.ChatCompletionResponse("id", "m", 0, 0, 0)
    for c in chunks:
        resp.accumulate(c)
    msg = json.loads(resp.to_json())["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or ()]
    return msg.get("content") or "", calls


NAMED = {"content": "Checking.", "tool_calls": [call("w1", "get_weather", {"city": "Paris", "days": 2}),
                                                call("w2", "search", {"q": "x", "filters": {"k": [1, None, True]}})]}
COMPLETIONS = ["Just text.", "Two\n\nparagraphs, <b>tags</b>, DSML-free."] + [
    ref_assistant_text(m) for m in (A_CALLS, CASES[9][0][1], CASES[10][0][1], {"role": "assistant", **NAMED})
]


@pytest.mark.parametrize("text", COMPLETIONS)
def test_parse_equals_reference(text: str) -> None:
    want_content, want_calls = ref_parse(text)
    content, calls = parse_completion(text)
    assert content == want_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
    # Streamed in pieces of any size: the same content, and deltas whose arguments join to the same strings.
    for step in (1, 3, 7, len(text)):
        got_content, got_calls = _stream(text, step=step)
        assert got_content == want_content, step
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == [
            (c["name"], c["arguments"]) for c in calls
        ], step


def test_completions_hold_calls() -> None:
    """The parse cases above are not vacuous: the reference finds 2, 1, 1 and 2 calls in the rendered turns."""
    assert [len(ref_parse(t)[1]) for t in COMPLETIONS] == [0, 0, 2, 1, 1, 2]


def test_broken_markup_is_content() -> None:
    """Our choice where the reference differs: text that breaks the markup before any call's name is complete
    is content, unparsed (the reference's parser drops what follows a "<｜DSML｜" it cannot read)."""
    for text in ("Hi\n\n<｜DSML｜tool_calls>\nnot an invoke\n</｜DSML｜tool_calls>",
                 "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\"> no newline </｜DSML｜invoke>",
                 "Hi\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # no call in the block
                 "Hi\n\n<｜DSML｜tool_callz>"):  # fmt: skip
        assert parse_completion(text) == (text, [])
        for step in (1, 5, len(text)):
            assert _stream(text, step=step) == (text, []), (text, step)


def test_markup_broken_after_a_name_keeps_the_call() -> None:
    """Once a call's name went out (streamed), markup that breaks its invoke drops the block's rest: the call
    stays with the arguments sent so far, no raw markup follows it. The whole-text twin reads such text as
    content: it never saw a name go out."""
    text = ('Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">v'
            '</｜DSML｜parameter>\nnot a parameter\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert parse_completion(text) == (text, [])
    for step in (1, 5, len(text)):
        content, calls = _stream(text, step=step)
        assert content == "Hi" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"k": "v"')], step


def _stream(text: str, truncated: bool = False, step: int = 4) -> tuple[str, list[dict[str, Any]]]:
    """`text` through a ToolStream in pieces of `step` characters: (content, the calls its deltas build).
    Each call's first delta has its id, type and name, the later ones arguments only, indices in order."""
    st, content, calls = ToolStream(), "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for piece in [*pieces, None]:
        c, deltas = st.push(piece) if piece is not None else st.finish(truncated=truncated)
        content += c
        for d in deltas:
            if d["index"] == len(calls):
                assert set(d) == {"index", "id", "type", "function"} and d["function"]["name"], d
                calls.append({**d, "function": dict(d["function"])})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert calls == st.calls
    return content, calls


INVOKE_F = ('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>')


def test_cut_call_comes_back_partial() -> None:
    """max_tokens cuts the answer inside the block (finish "length"): the complete calls are kept whole, the cut
    one comes back with the arguments written so far (issue 62: it vanished), no raw markup in the content."""
    block = "Hi\n\n<｜DSML｜tool_calls>\n" + INVOKE_F + "\n" + INVOKE_F
    second = len(block) - len(INVOKE_F)
    # The cut inside the second invoke: its name incomplete (dropped), complete, a value opened, written, closing.
    v = second + INVOKE_F.index('">v<') + 2  # where the second call's value starts
    cuts = {second + 20: None, second + 30: "", v: '{"k": "', v + 1: '{"k": "v', v + 10: '{"k": "v',
            len(block) - 1: '{"k": "v"', second - 1: None}  # fmt: skip
    for cut, partial in cuts.items():
        for step in (1, 4, cut):
            content, calls = _stream(block[:cut], truncated=True, step=step)
            want = [("f", '{"k": "v"}')] + ([] if partial is None else [("f", partial)])
            assert content == "Hi" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want, (
                cut, step, calls)
    # Cut inside the block's opening tag or the first call's name: nothing parsed, nothing raw.
    assert _stream("Hi\n\n<｜DS", truncated=True) == ("Hi", [])
    assert _stream("Hi\n\n", truncated=True) == ("Hi\n\n", [])  # a blank line alone is text
    assert _stream("Hi\n\n<｜DS") == ("Hi\n\n<｜DS", [])  # the model's own end: its text
    assert _stream("Hi\n\n<｜DSML｜tool_calls>\n" + INVOKE_F[:20], truncated=True) == ("Hi", [])
    # Not truncated (the model stopped mid-markup, before any name): the text is content, as broken markup.
    cut = "Hi\n\n<｜DSML｜tool_calls>\n" + INVOKE_F[:20]
    assert _stream(cut) == (cut, [])


def test_string_value_streams_in_pieces() -> None:
    """A string value goes out as it comes (escaped piece by piece), a closing tag's possible start held; a JSON
    value at its closing tag: the first delta holds the name only, the arguments follow in several deltas."""
    text = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="s" string="true">'
            'a "q" <b> \\ é</｜DSML｜parameter>\n<｜DSML｜parameter name="n" string="false"> [1, {"x": 2}] '
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    st, deltas = ToolStream(), []
    for ch in text:
        content, ds = st.push(ch)
        assert content == ""
        deltas += ds
    assert st.finish() == ("", [])
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) > 10 and "".join(pieces) == parse_completion(text)[1][0]["arguments"]
    assert json.loads("".join(pieces)) == {"s": 'a "q" <b> \\ é', "n": [1, {"x": 2}]}


def test_markup_broken_after_a_call_is_dropped() -> None:
    """Text that breaks the block after a complete call: the call is kept and the rest dropped (as the reference
    parser does), streamed in any piece size; no call is emitted twice or lost from `calls`."""
    text = "Hi\n\n<｜DSML｜tool_calls>\n" + INVOKE_F + "\nnot markup at all\n</｜DSML｜tool_calls> and more"
    for step in (1, 3, 7, len(text)):
        content, calls = _stream(text, step=step)
        assert content == "Hi" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"k": "v"}')], step
    assert ref_parse(text)[1] == [("f", {"k": "v"})]  # the reference keeps the call too


def test_json_value_cut_and_repeated_parameter() -> None:
    """A JSON value cut by max_tokens goes out as far as it was written (the call's arguments stay cut); a repeated
    parameter breaks the invoke (its arguments could not be one JSON object): the call keeps what went out."""
    head = 'Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">'
    for step in (1, 6, 200):
        assert _stream(head + ' [1, {"a"', truncated=True, step=step)[1][0]["function"]["arguments"] == (
            '{"n": [1, {"a"')
        assert _stream(head + " 7</｜DSM", truncated=True, step=step)[1][0]["function"]["arguments"] == '{"n": 7'
    again = (head + "1</｜DSML｜parameter>\n" + head[head.index("<｜DSML｜parameter") :] + "2</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")  # fmt: skip
    assert parse_completion(again) == (again, [])
    content, calls = _stream(again)
    assert content == "Hi" and [c["function"]["arguments"] for c in calls] == ['{"n": 1']

"""Constrained decoding with xgrammar: structural-tag formats for JSON schemas, regexes, choices and
DeepSeek-V4 tool calls (the API compiles them in a process of its own, service/api/grammar_pool.py), and the
per-row token masks the batched sampler applies (`sampler.apply_masks`).

Why xgrammar: at 8 rows on this 2-core CPU its accept + mask step costs ~37 us at the tiny model's
512 ids and ~110 us at 32K ids, against llguidance's ~210 us and ~2.2-3.4 ms (`tools/grammar_mask.py`;
docs/http.md has the figures), and its structural tags compose the DSML tool-call grammar
(service/api/tools.py) from JSON-schema, regex and literal pieces.

A guided request's matcher lives on its Request (`guide_state`, engine thread only) and is advanced
lazily: before each mask it accepts the tokens generated since the last one, so a step queued ahead
(pipelined decode) needs nothing special. Rows without a guide cost nothing; a step with no guided row
returns no mask at all. This module imports no mlx (the API side compiles grammars with it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsv4_serve.service.engine.request import Guide, Request

log = logging.getLogger(__name__)

_lock = threading.Lock()
_compilers: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, xgrammar.GrammarCompiler)
_infos: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, xgrammar.TokenizerInfo)


# A JSON string's characters (RFC 8259): no raw control characters, which xgrammar's string rule lets
# through; escapes count as one character, as maxLength counts them.
_JSON_CHAR = r'([^\x00-\x1f"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'


def _strict_strings(schema: Any) -> Any:
    """`schema` with every plain string (no pattern, format, enum or const) given a pattern of valid JSON
    string characters, within its minLength..maxLength."""
    if isinstance(schema, list):
        return [_strict_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict_strings(v) for k, v in schema.items()}
    if out.get("type") == "string" and not ({"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_JSON_CHAR}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


# ---- formats (xgrammar structural-tag JSON; plain dicts so the API side needs no xgrammar types) -----
def json_format(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """One JSON value matching `schema`, at most one whitespace character in a row (a model cannot wander
    in whitespace forever)."""
    return {"type": "json_schema", "json_schema": _strict_strings(schema), "max_whitespace_cnt": 1}


def regex_format(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def choice_format(choices: Sequence[str]) -> dict[str, Any]:
    return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}


def after_reasoning(fmt: dict[str, Any]) -> dict[str, Any]:
    """Thinking mode: free reasoning text, </think>, then `fmt` (the constraint applies to the answer)."""
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    return {"type": "sequence", "elements": [think, fmt]}


# ---- compiling (the API compiles in a process of its own: service/api/grammar_pool.py) -------------
def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """xgrammar's TokenizerInfo of `tokenizer` at the model's logit width, built once per tokenizer (the
    vocabulary scan)."""
    import xgrammar as xgr

    with _lock:
        hit = _infos.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        n = tokenizer.get_vocab_size()
        vocab = [tokenizer.id_to_token(i) or "" for i in range(min(n, vocab_size))]
        vocab += [""] * (vocab_size - len(vocab))  # logit ids the tokenizer lacks: never allowed
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                 stop_token_ids=[] if eos_token_id is None else [eos_token_id])  # fmt: skip
        _infos[id(tokenizer)] = (tokenizer, info)
        return info


def _compiler(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """One GrammarCompiler (with its cache) per tokenizer, in this process (tests, tools)."""
    import xgrammar as xgr

    info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
    with _lock:
        hit = _compilers.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        comp = xgr.GrammarCompiler(info, max_threads=2)
        _compilers[id(tokenizer)] = (tokenizer, comp)
        return comp


# The project installs from its checkout (README): the extra's command as a server's operator types it there.
INSTALL = "(xgrammar: pip install -e '.[structured]' in the dsv4-serve checkout)"


def compile_guide(tokenizer: Any, vocab_size: int, eos_token_id: int | None, fmt: dict[str, Any],
                  source: str) -> Guide:  # fmt: skip
    """A compiled grammar for `fmt`; ValueError (the API's 400) naming `source` if it does not compile."""
    try:
        compiled = _compiler(tokenizer, vocab_size, eos_token_id).compile_structural_tag(
            {"type": "structural_tag", "format": fmt}
        )
    except ModuleNotFoundError:
        raise ValueError(f"{source} needs the grammar engine, not installed on this server {INSTALL}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad schemas/regexes
        raise ValueError(f"{source} cannot be enforced: {e}") from None
    return Guide(compiled, source)


# ---- the engine side ----------------------------------------------------------------------------
# A row's mask (accept + fill) may take MASK_BUDGET seconds a step; a row over it STRIKES times is ended with
# a 400-class error (never the batch). xgrammar's mask cost on an ambiguous regex grows with the generated
# length (issue 63: `([a-z ]*[a-z ]*)*x` at 512 ids, one row: 0.1 ms at token 10, 5.6 ms at 50, 77 ms at 100,
# 337 ms at 223), while a JSON schema's is ~5 us a row at 512 ids and ~14 us at 32K; the budget is ~1,000x
# that and about a tiny-model step on this 2-core CPU, and a few strikes ride out a busy CPU's preemptions.
MASK_BUDGET = 0.02
STRIKES = 3


class _State:
    """One guided row: its matcher, how many of its generated tokens it has accepted, and its masks over
    budget so far."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0
        self.failed = False
        self.strikes = 0


class Guides:
    """Engine-side masks for the guided rows of one step. `vocab_size`: the model's logit width; `mask_budget`:
    seconds one row's mask may take a step (`STRIKES` times over it: the row is ended, `over_budget`)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, mask_budget: float = MASK_BUDGET) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.words = (vocab_size + 31) // 32
        self.mask_budget = mask_budget
        self._over: list[Request] = []  # rows past their strikes, not yet ended (engine thread only)

    def over_budget(self) -> list[tuple[Request, str]]:
        """The rows whose masks went over budget `STRIKES` times since the last call, each with its error
        message (naming the field that asked for the grammar): the caller ends them."""
        over, self._over = self._over, []
        return [(r, too_slow(r, self.mask_budget)) for r in over]

    def masks(self, rows: Sequence[Request]) -> np.ndarray | None:
        """[B, ceil(V / 32)] int32 packed masks (bit v of row b: token v allowed), or None when no row is
        guided. Unguided rows get every bit. A row whose grammar refused a token (it cannot happen through
        the mask; a bug) is allowed EOS only, so it ends instead of leaving its grammar."""
        guided = [(i, r) for i, r in enumerate(rows) if r.params.guide is not None]
        if not guided:
            return None
        import xgrammar as xgr

        out = np.full((len(rows), self.words), -1, dtype=np.int32)
        for i, r in guided:
            t0 = time.perf_counter()
            st = r.guide_state
            if st is None:
                st = r.guide_state = _State(xgr.GrammarMatcher(r.params.guide.grammar))  # type: ignore[union-attr]
            for t in r.output_ids[st.accepted :]:
                if not st.failed and not st.matcher.accept_token(t):
                    log.error("request %s: token %d refused by its grammar", r.request_id, t)
                    st.failed = True
            st.accepted = len(r.output_ids)
            if st.failed or st.matcher.is_terminated():
                out[i] = 0
                if self.eos_token_id is not None:
                    out.view(np.uint32)[i, self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)
            else:
                st.matcher.fill_next_token_bitmask(out, i)
            if time.perf_counter() - t0 > self.mask_budget and not st.failed:  # the mask itself is right: used
                st.strikes += 1
                if st.strikes == STRIKES:
                    self._over.append(r)
        return out


def too_slow(r: Request, budget: float) -> str:
    source = r.params.guide.source if r.params.guide is not None else "the grammar"
    return (f"{source}: its grammar's token mask took over {budget * 1e3:g} ms a token {STRIKES} times "
            "(an ambiguous pattern, such as a repeat of a repeat); the request was ended so as not to slow the "
            "others: make the pattern unambiguous")


def tokens_allowed(masks: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    """The allowed token ids of one row of `masks` (tests, benchmarks)."""
    bits = np.unpackbits(masks[row].view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)

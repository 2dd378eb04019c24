"""Grammars a reply must match (a JSON schema, any JSON object, a tool call), through
llguidance: each is compiled for the model's tokenizer into a matcher that says, at every
position, which tokens may come next, and which ones the grammar forces.

llguidance was chosen over xgrammar by measurement on a 2-core AMD EPYC (AVX-512 VNNI),
bundled tokenizer (49,152 tokens), a 7-field schema: a mask costs ~10 us a token (median;
mean 16-18 us) against xgrammar's ~2-4 us, both under 0.3% of a plain decode step there, and
llguidance installs as one 3 MB wheel with no dependencies where xgrammar brings triton
(~200 MB) to every CPU install. It also gives the forced tokens themselves
(`compute_ff_tokens`), the grammar's draft source (engine/drafters/grammar_source.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import QuickdraftError

# Compact JSON, no free whitespace: keys, separators and enum values are then forced, so
# the grammar's draft source can offer them (flexible whitespace would leave every
# position open to a space or a newline).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(QuickdraftError):
    """A schema or grammar that cannot be compiled (the message names why)."""


@dataclass(frozen=True)
class Grammar:
    """A grammar a reply must match, as llguidance reads it (see the constructors below)."""

    text: str  # llguidance's grammar (JSON schema or Lark, compiled to its own form)
    label: str  # what it is, for errors ("the JSON schema 'person'")

    def start(self, lm) -> Matcher:
        """A reply's matcher at the grammar's start, for `lm`'s tokenizer."""
        return Matcher(lm, self)


def json_schema(schema: dict, name: str = "") -> Grammar:
    """A reply that is one JSON value valid under `schema` (OpenAI's strict json_schema)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        text = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema {name!r} cannot be read: {exc}") from exc
    return Grammar(text, f"the JSON schema {name!r}" if name else "the JSON schema")


def json_object() -> Grammar:
    """Any JSON object (OpenAI's json_object)."""
    return json_schema({"type": "object"}, "json_object")


def lark(text: str, label: str) -> Grammar:
    """A grammar in llguidance's Lark dialect (%json{...} embeds a JSON schema)."""
    return Grammar(_llg().LLMatcher.grammar_from_lark(text), label)


def check(lm, grammar: Grammar) -> None:
    """Raise GrammarError when `grammar` does not compile for `lm`'s tokenizer."""
    error = _llg().LLMatcher.validate_grammar(grammar.text, tokenizer_of(lm))
    if error:
        raise GrammarError(f"{grammar.label} cannot be used: {error.splitlines()[0]}")


def tokenizer_of(lm):
    """llguidance's view of `lm`'s tokenizer over the logits' width and its EOS tokens,
    built once per loaded model (~1 s) and kept on it."""
    key = "llguidance-tokenizer"
    if key not in lm.grammars:
        from llguidance.hf import from_tokenizer

        lm.grammars[key] = from_tokenizer(lm.tokenizer, n_vocab=vocab_width(lm),
                                          eos_token=list(lm.eos_ids))
    return lm.grammars[key]


def vocab_width(lm) -> int:
    """Tokens the model's logits score (may exceed the tokenizer's own count: padding)."""
    return max(int(lm.model.config.vocab_size), len(lm.tokenizer))


class Matcher:
    """One reply's position in a grammar: which tokens may follow, which are forced. The
    reply's tokens go in with `consume`; a draft's are tried and taken back (`rollback`)."""

    def __init__(self, lm, grammar: Grammar):
        llg = _llg()
        self._tok = tokenizer_of(lm)
        self._m = llg.LLMatcher(self._tok, grammar.text, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{grammar.label} cannot be used: {self._m.get_error()}")

    def allowed(self, out: torch.Tensor) -> None:
        """Write into `out` ((V,) uint8, CPU) 1 for each token that may come next, else 0
        (V: the model's logits; tokens past the tokenizer's are never allowed)."""
        bias = torch.frombuffer(bytearray(self._m.compute_logit_bias()), dtype=torch.uint8)
        out.zero_()
        width = min(out.shape[0], bias.shape[0])
        out[:width] = bias[:width] != 0

    def consume(self, token: int) -> bool:
        """Take `token` if the grammar allows it here; False (and no change) otherwise."""
        if self._m.validate_tokens([token]) != 1:
            return False
        return self._m.consume_token(token)

    def advance(self, tokens: list[int]) -> None:
        """Take the reply's new tokens (each allowed by construction; once the grammar is
        complete only the end of the reply follows, which it does not consume)."""
        for token in tokens:
            if self._m.is_stopped():
                return
            if not self._m.consume_token(token):
                raise GrammarError(f"the grammar refused the reply: {self._m.get_error()}")

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def forced(self) -> list[int]:
        """Tokens for the text the grammar forces from here ([] where it allows a choice):
        the tokens it forces outright, then the canonical tokens of the forced text they
        leave out (its last piece, which the next free text could join: the model may
        spell it otherwise, so these are a guess)."""
        if self._m.is_stopped():
            return []
        tokens = list(self._m.compute_ff_tokens())
        text, spelled = self._m.compute_ff_bytes(), self._tok.decode_bytes(tokens)
        if not text.startswith(spelled):  # the tokens re-spell text already taken
            return tokens
        rest = text[len(spelled):]
        return tokens + (list(self._tok.tokenize_bytes(rest)) if rest else [])

    def finished(self) -> bool:
        """Whether the grammar is complete (only the end of the reply may follow)."""
        return self._m.is_stopped() or self._m.is_accepting()


def _llg():
    """llguidance, imported on first use (the page starts without it)."""
    import llguidance

    return llguidance

"""Mistral's Tekken tokenizer as a ChatFormat: mistral-common renders the conversation, not a template.

A Tekken checkpoint (tekken.json beside config.json: Mistral NeMo, Pixtral, Ministral) has no Jinja
chat template that vLLM uses: vLLM's MistralTokenizer encodes a chat request to ids with
mistral-common's instruct tokenizer. `TekkenFormat` does the same, so the prompt ids are exactly the
ones vLLM would build, and gives the accumulator what it needs from any ChatFormat:

- `render`: mistral-common's encoding of the request, as text with the control tokens spelled out
  (`<s>[AVAILABLE_TOOLS]...[/AVAILABLE_TOOLS][INST]...[/INST]`), which is what `Tokenized.text` is;
- `encode`: that text back to mistral-common's ids: control tokens by their special ids, each text
  piece between them by the Tekkenizer without BOS/EOS. mistral-common encodes every text piece on
  its own between control tokens, so splitting at them reproduces its ids (tests/test_tekken.py);
- `decode` / `text_units`: from the Tekkenizer's byte pieces (there is no HF `tokenizers` backend).

What this does to accumulation (the v3 instruct encoding of both Tekken files mistral-common ships,
the NeMo tokenizer): [AVAILABLE_TOOLS] and the system prompt sit in front of the last user message
(mistral-common 1.13 keeps earlier tool calls and results in the history; older versions dropped
them), so a new user turn rewrites the history (template_rewrite) whenever there are tools or a
system prompt, while tool results after a tool call extend the exact sampled ids. Tekken has no leading-space trap
after [TOOL_CALLS] (the SentencePiece v3 tokenizer has).

`tokenizer` is vLLM's MistralTokenizer (the loopback's tool parser, `mistral`, reads Tekken's
`[TOOL_CALLS][{...}]` with it). Text that spells a control token ('[INST]', an HTML '<s>' in a tool
result) is text to mistral-common, so to vLLM. The render therefore escapes it (ESCAPE after the
name's first character; a literal ESCAPE doubled), and `encode` splits only at unescaped names: it
used to turn such text into the control token, a prompt vLLM never builds (BOS or EOS mid-prompt).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from .tokens import ChatFormat, canonical_message

ESCAPE = "\ue000"  # a private-use character: marks text that spells a control token (see the module docstring)
_UNESCAPE = re.compile(ESCAPE + "(" + ESCAPE + ")?")


def tekken_profile(path: str | Path):
    """The `mistral` profile of a Tekken directory: profile_for's when it is a checkpoint (config.json),
    else the mistral family's for a tokenizer directory (chat_format "tekken": it has tekken.json)."""
    from .profiles import FAMILIES, Checkpoint, profile_for

    path = Path(path)
    if (path / "config.json").is_file():
        return profile_for(path)
    return FAMILIES["mistral"](Checkpoint(path, {"model_type": "mistral"}, set(), None))


def load_tokenizer(path: str | Path):
    """vLLM's MistralTokenizer for a directory with tekken.json (offline: the file is read as is)."""
    from vllm.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_pretrained(str(path))


def _renderable(m: dict, both: bool = False) -> dict:
    """An assistant message as mistral-common will encode it. A v3 tokenizer's validator refuses
    content beside tool calls (v7 and later take it: `both`), and every version's encoder a message
    with neither (v7's raised "Invalid assistant message"), yet the policy samples both (text before
    [TOOL_CALLS], which the `mistral` parser hands out beside the call; a bare </s>): sent back,
    every later request of the episode was refused (400) and the episode failed, the loop dropping
    it. The call renders without the text, the empty reply as a space (which renders as nothing).
    The next turn still extends the sampled ids, text included (the accumulator's renders, before
    and after, are both of this form); a new segment's prompt renders the call without it."""
    if m["role"] != "assistant":
        return m
    if m.get("tool_calls") and m.get("content") and not both:
        return {**m, "content": ""}
    if not m.get("tool_calls") and not m.get("content"):
        return {**m, "content": " "}
    return m


class TekkenFormat(ChatFormat):
    """ChatFormat over mistral-common's request encoding (see the module docstring)."""

    @staticmethod
    def is_refusal(error: BaseException) -> bool:
        """Whether `error` is mistral-common refusing the messages (the loopback answers it 400 as a
        template's refusal, uncounted): its validation's exceptions, and a ValueError raised in its
        own code (an unknown role). Any other ValueError is not: unexpected_errors counts it."""
        from mistral_common.exceptions import MistralCommonException

        if isinstance(error, MistralCommonException):
            return True
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return isinstance(error, ValueError) and tb is not None and "/mistral_common/" in tb.tb_frame.f_code.co_filename

    def __init__(self, tokenizer, end_of_turn: str | None = "</s>", template_kwargs: dict | None = None,
                 turn_ends: tuple[str, ...] = (), message_form: dict | None = None):
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        if not hasattr(tokenizer, "mistral"):
            raise TypeError(f"TekkenFormat needs vLLM's MistralTokenizer (workbench.tekken.load_tokenizer(checkpoint)), "
                            f"got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer  # vLLM's MistralTokenizer
        self.mistral = tokenizer.mistral  # mistral-common's MistralTokenizer (validation mode "test": serving)
        self.tekken = self.mistral.instruct_tokenizer.tokenizer
        if type(self.tekken).__name__ != "Tekkenizer":
            raise TypeError(f"TekkenFormat needs a Tekken tokenizer, got {type(self.tekken).__name__}")
        # A history that ends with the assistant's reply (Accumulator.record renders it) is a
        # "finetuning" request to mistral-common's validator (serving refuses a final assistant
        # message); the same validator class in that mode, the same tokenizer otherwise.
        self._history = copy.copy(self.mistral)
        self._history._chat_completion_request_validator = type(self.mistral._chat_completion_request_validator)(
            mode=ValidationMode.finetuning)
        # v7+ validators take content beside tool calls; v3's refuse it (_renderable)
        self._both_or_neither = bool(getattr(self.mistral._chat_completion_request_validator,
                                             "_allow_tool_call_and_content", False))
        self._keep = SpecialTokenPolicy.KEEP
        self._ignore = SpecialTokenPolicy.IGNORE
        n = self.tekken.num_special_tokens
        self._special = {self.tekken.id_to_piece(i): i for i in range(n)}
        self._special_re = re.compile("(" + "|".join(map(re.escape, sorted(self._special, key=len, reverse=True))) + ")")
        self.end_of_turn = end_of_turn or "</s>"
        self.turn_end_tokens = tuple(dict.fromkeys((self.end_of_turn, *turn_ends)))
        unknown = [t for t in self.turn_end_tokens if t not in self._special]
        if unknown:  # (a KeyError: a traceback from the linter's CLI, not its error line)
            raise ValueError(f"{unknown} is no control token of this Tekken tokenizer")
        self.end_of_turn_id = self._special[self.end_of_turn]
        self.turn_end_ids = tuple(self._special[t] for t in self.turn_end_tokens)
        self.special_ids = frozenset(self._special.values())  # (as ChatFormat's: a turn ended on one)
        self.template_kwargs = dict(template_kwargs or {})  # mistral-common takes none; kept for the interface
        self.message_form = dict(message_form or {})

    @classmethod
    def for_profile(cls, tokenizer, profile) -> "TekkenFormat":
        return cls(tokenizer, profile.end_of_turn, profile.chat_template_kwargs, profile.turn_ends, profile.message_form)

    def tokenize_request(self, messages: list[dict], tools: list | None, add_generation_prompt: bool):
        """mistral-common's Tokenized for OpenAI-style messages (ids in .tokens, text in .text)."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        msgs = [canonical_message(m, **self.message_form) for m in messages]
        for i, m in enumerate(msgs):
            if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
                # mistral-common's from_openai raised a bare KeyError: an agent read "cannot render these
                # messages: 'tool_call_id'", and the loopback counted it as its own unexpected error
                from mistral_common.exceptions import InvalidToolMessageException

                raise InvalidToolMessageException(
                    f"messages[{i}] is a tool result without a tool_call_id: Mistral's encoding pairs every "
                    f"tool result with the id of the call it answers (the assistant's tool_calls[].id)")
        msgs = [_renderable(m, both=self._both_or_neither) for m in msgs]
        final_reply = bool(msgs) and msgs[-1]["role"] == "assistant" and not add_generation_prompt
        req = ChatCompletionRequest.from_openai(msgs, tools or None)
        try:
            return (self._history if final_reply else self.mistral).encode_chat_completion(req)
        except Exception as e:  # mistral-common's refusal of a call id names the id, not the message
            import re

            from mistral_common.exceptions import InvalidFunctionCallException, InvalidToolMessageException

            said = re.search(r"[Tt]ool call id was (\S+?)[,:.]? but", str(e))
            if not isinstance(e, (InvalidFunctionCallException, InvalidToolMessageException)) or said is None:
                raise
            at = [i for i, m in enumerate(msgs) if m.get("tool_call_id") == said.group(1)
                  or any(c.get("id") == said.group(1) for c in m.get("tool_calls") or [])]
            if not at:
                raise
            raise type(e)(f"messages[{at[0]}]: {e}") from e

    def renders_the_same_with(self, extra: dict) -> bool:
        """Whether a request's template kwargs `extra` render as the profile's (ChatFormat's
        contract): mistral-common reads no chat template kwargs; a reasoning effort it encodes from
        some versions on (v15), so that one is probed: with and without it, on one user message.
        (ChatFormat's own read a Jinja template this tokenizer has not: every request sending
        chat_template_kwargs or reasoning_effort was a 400 naming a schema error.)"""
        effort = extra.get("reasoning_effort")
        if effort is None:
            return True
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        def ids(**kw) -> list[int]:
            return self.mistral.encode_chat_completion(ChatCompletionRequest.from_openai(
                [{"role": "user", "content": "."}], None, **kw)).tokens

        try:
            return ids() == ids(reasoning_effort=effort)
        except Exception:  # noqa: BLE001  (an effort its version refuses, or no such field: not the same)
            return False

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool, refuse_dropped: bool = True) -> str:
        """mistral-common's ids as text: control tokens by name, each text piece between them
        decoded and escaped where it spells a control token (mistral-common's own .text does not
        tell the two apart)."""
        return self.escaped_decode(self.tokenize_request(messages, tools, add_generation_prompt).tokens)

    def escaped_decode(self, ids: list[int]) -> str:
        """`ids` as text that encode() reads back as the same ids: control tokens by name, each text
        piece between them decoded and escaped where it spells a control token (a plain decode
        writes a sampled "</s>" text and the end of sequence alike, and encode made both the
        control: tokens.retokenization_drift counted a reply's HTML "<s>10</s>" as drift)."""
        n, out, run = self.tekken.num_special_tokens, [], []
        for i in [*ids, None]:
            if i is not None and i >= n:
                run.append(i)
                continue
            if run:
                piece = self.tekken.decode(run, special_token_policy=self._keep).replace(ESCAPE, ESCAPE * 2)
                out.append(self._special_re.sub(lambda m: m.group(0)[0] + ESCAPE + m.group(0)[1:], piece))
                run = []
            if i is not None:
                out.append(self.tekken.id_to_piece(i))
        return "".join(out)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for k, piece in enumerate(self._special_re.split(text)):
            if k % 2:  # a control token, spelled out
                ids.append(self._special[piece])
            elif piece:  # text, unescaped: what mistral-common encoded
                ids += self.tekken.encode(_UNESCAPE.sub(lambda m: m.group(1) or "", piece), bos=False, eos=False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tekken.decode(list(ids), special_token_policy=self._ignore if skip_special_tokens else self._keep)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """tokens.ChatFormat.token_bytes for Tekken: mistral-common's byte piece of each id."""
        return [self.tekken.id_to_byte_piece(int(i), self._keep) for i in ids]

    def text_units(self, ids: list[int]) -> list[tuple[int, int, tuple]] | None:
        """tokens.text_units for Tekken: byte pieces grouped until they complete UTF-8 characters."""
        units, pos, start, buf = [], 0, 0, b""
        for k, i in enumerate(ids):
            buf += self.tekken.id_to_byte_piece(i, self._keep)  # a control token: its name
            try:
                chunk = buf.decode("utf-8")
            except UnicodeDecodeError:
                if k + 1 - start > 16:
                    return None
                continue
            units.append((pos, pos + len(chunk), tuple(ids[start: k + 1])))
            pos, start, buf = pos + len(chunk), k + 1, b""
        if start < len(ids):
            units.append((pos, -1, tuple(ids[start:])))
        return units

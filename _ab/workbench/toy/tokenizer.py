"""A deterministic tiny byte-level BPE tokenizer with a Qwen-style chat template.

Byte-level BPE on purpose: like real LLM tokenizers, it does not round-trip sampled ids. The
model can sample `"1"`,`"2"` where the canonical tokenization of the text "12" is one merged
token, which is exactly the retokenization drift that the token-identity invariant guards against.

Template (ChatML-like):
    <|im_start|>{role}\\n{content}<|im_end|>\\n
Tools are listed in the system turn as JSON lines after "# Tools"; an assistant's tool calls are
rendered as <tool_call>{"name": ..., "arguments": {...}}</tool_call> after its content.
"""

from __future__ import annotations

from pathlib import Path

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
VOCAB_SIZE = 512  # total, special tokens included; the tiny models use exactly this many rows

# Jinja; '\n' inside Jinja string literals is a newline. Every output comes from an expression,
# so whitespace control ({%- -%}) cannot eat template text.
CHAT_TEMPLATE = r"""{%- set ns = namespace(start=0) -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if tools or ns.start == 1 -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.start == 1 -%}{{- messages[0].content -}}{%- endif -%}
{%- if tools -%}
{%- if ns.start == 1 -%}{{- '\n\n' -}}{%- endif -%}
{{- '# Tools' -}}
{%- for tool in tools -%}{{- '\n' -}}{{- tool | tojson -}}{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}
{{- raise_exception('unknown role: ' ~ message.role) -}}
{%- endif -%}
{{- '<|im_start|>' ~ message.role ~ '\n' -}}
{%- if message.content is string -%}{{- message.content -}}
{%- elif message.content -%}
{%- for part in message.content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for tc in message.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{%- if not loop.first or message.content -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>{"name": "' ~ f.name ~ '", "arguments": ' -}}
{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}
{{- '}</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def train_tokenizer(corpus: list[str]):
    """Train the byte-level BPE on `corpus` and wrap it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [EOT, IM_START, IM_END]
    added = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]  # not "special": decode must keep them
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(special) - len(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=EOT, unk_token=None, bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"toy tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}: corpus too small")
    return fast


def build_tokenizer(out_dir: Path, seed: int = 0):
    from .tasks import tokenizer_corpus

    fast = train_tokenizer(tokenizer_corpus(seed))
    fast.save_pretrained(str(out_dir))
    return fast

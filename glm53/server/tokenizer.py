"""Tokenizer, chat template and streaming text assembly for the router.

- `Tokenizer`: `tokenizer.json` from the model directory (the `tokenizers` library), the chat
  template from `chat_template.jinja` if present, else `tokenizer_config.json`'s `chat_template`,
  rendered with a sandboxed jinja2 environment configured like Hugging Face's (trim_blocks,
  lstrip_blocks, a non-HTML-escaping `tojson`, `raise_exception`), so real GLM templates render
  byte-identically. `encode`/`decode` release the GIL (the batch entry points of `tokenizers`
  do; the single ones do not), so they may run in worker threads beside the event loop;
  `min_tokens` is a certain lower bound on a text's token count, computed without tokenizing.
  `Tokenizer.ids_only` is the model's ids without text (`model.skip_tokenizer_init`, a directory
  with no tokenizer): encoding or templating raises `NoTokenizer`, decoding gives "".
- `IncrementalDetokenizer`: text deltas for a growing token list that never split a multi-byte
  character: a delta is released only when the decoded window does not end in U+FFFD.
- `StopStringMatcher`: finds stop strings in streamed text, holding back any tail that could be
  the start of one, so a stop string never reaches the client.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (maps to HTTP 400)."""


class NoTokenizer(ValueError):
    """Text was asked of a server that runs without a tokenizer (maps to HTTP 400)."""

    def __init__(self, what: str):
        super().__init__(f"{what}: this server runs without a tokenizer (model.skip_tokenizer_init); send "
                         "prompts as token ids and stop with stop_token_ids")


@dataclass
class GenerationDefaults:
    """generation_config.json's sampling defaults (used when a request leaves a field unset)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None


@dataclass
class Tokenizer:
    model_dir: Path
    tok: HFTokenizer | None  # None: ids only (`ids_only`)
    chat_template: str | None
    eos_token_ids: list[int]
    special_ids: set[int]
    vocab_size: int
    max_position_embeddings: int | None
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token: str | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # Most input bytes one token can stand for; None when the pipeline can drop or fuse text
    # (then no cheap lower bound on the token count is certain).
    max_token_bytes: int | None = None
    _template: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template_path: str | None = None) -> "Tokenizer":
        d = Path(model_dir)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: not found (the router needs a tokenizers-format tokenizer)")
        tok = HFTokenizer.from_file(str(tok_file))
        # A server answers for every token: never silently cut or pad a prompt.
        tok.no_truncation()
        tok.no_padding()
        # BPE's word cache (10K entries) fills during the first long prompt, its entries spread
        # through that prompt's freed memory, which then stays resident (~50 MB after a 4 MB
        # prompt, measured); without it the heap trims back to its baseline, at no measured
        # cost in speed.
        if hasattr(tok.model, "_resize_cache"):
            tok.model._resize_cache(0)
        tcfg = _read_json(d / "tokenizer_config.json")
        mcfg, gcfg = _read_json(d / "config.json"), _read_json(d / "generation_config.json")

        template = None
        if chat_template_path:
            template = Path(chat_template_path).read_text()
        elif (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(tcfg.get("chat_template"), str):
            template = tcfg["chat_template"]
        elif isinstance(tcfg.get("chat_template"), list):  # [{name, template}, ...]
            named = {t.get("name"): t.get("template") for t in tcfg["chat_template"] if isinstance(t, dict)}
            template = named.get("default")

        special = {int(i) for i, t in (tcfg.get("added_tokens_decoder") or {}).items() if t.get("special")}
        for t in tok.get_added_tokens_decoder().items() if hasattr(tok, "get_added_tokens_decoder") else []:
            if t[1].special:
                special.add(int(t[0]))

        eos_ids = _eos_ids(mcfg, gcfg)
        if not eos_ids and isinstance(tcfg.get("eos_token"), str):
            i = tok.token_to_id(tcfg["eos_token"])
            eos_ids = [i] if i is not None else []

        def token_str(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        return cls(
            model_dir=d, tok=tok, chat_template=template, eos_token_ids=eos_ids, special_ids=special,
            vocab_size=max(int(mcfg.get("vocab_size") or 0), tok.get_vocab_size(with_added_tokens=True)),
            max_position_embeddings=mcfg.get("max_position_embeddings"),
            eos_token=token_str(tcfg.get("eos_token")), pad_token=token_str(tcfg.get("pad_token")),
            bos_token=token_str(tcfg.get("bos_token")), defaults=_generation_defaults(gcfg),
            max_token_bytes=_max_token_bytes(tok),
        )

    @classmethod
    def ids_only(cls, model_dir: str | Path) -> "Tokenizer":
        """The model's vocabulary size, eos ids and sampling defaults from its config files, and no
        text (SGLang's and vLLM's skip_tokenizer_init): prompts come and go as token ids."""
        d = Path(model_dir)
        mcfg, gcfg = _read_json(d / "config.json"), _read_json(d / "generation_config.json")
        return cls(model_dir=d, tok=None, chat_template=None, eos_token_ids=_eos_ids(mcfg, gcfg), special_ids=set(),
                   vocab_size=int(mcfg.get("vocab_size") or 0),
                   max_position_embeddings=mcfg.get("max_position_embeddings"), defaults=_generation_defaults(gcfg))

    @property
    def has_text(self) -> bool:
        return self.tok is not None

    # ---- encode / decode ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The fast variant skips character offsets: less work, and far less to free afterwards
        # (that happens under the GIL: 0.3 s vs 0.07 s for a 4 MB prompt, measured).
        if self.tok is None:
            raise NoTokenizer("a text prompt")
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def decode_one(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode` for a few ids on the event loop (streaming): skips the batch machinery."""
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` that is certain (0 when none is known): every
        input byte ends up in exactly one token, and one token stands for at most
        `max_token_bytes` bytes of the (normalized) text."""
        if not self.max_token_bytes or not text:
            return 0
        if self.tok.normalizer is not None:
            text = self.tok.normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token) if self.tok is not None else None

    # ---- chat template ----
    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """The rendered prompt. `continue_final_message` (Hugging Face's): the text ends right
        after the last message's content (its end-of-turn markup cut), so the answer continues it."""
        if self.tok is None:
            raise NoTokenizer("a chat request")
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (chat_template.jinja or tokenizer_config.json)")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        try:
            text = self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                eos_token=self.eos_token, bos_token=self.bos_token, pad_token=self.pad_token, **kwargs,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template cannot render these messages: {e}") from None
        return _cut_after_final(text, messages[-1] if messages else {}) if continue_final_message else text


# Pre-tokenizers that keep every input character (they split or map text, never drop it).
_LOSSLESS_PRE = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "Sequence"}


def _max_token_bytes(tok: HFTokenizer) -> int | None:
    """The most input bytes one token can cover, if that is bounded and every input byte is
    covered by some token: a BPE model with no fused unknowns, a pre-tokenizer that drops
    nothing, and added tokens that absorb no surrounding whitespace. None otherwise."""
    cfg = json.loads(tok.to_str())
    model = cfg.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None

    def lossless(pre: Any) -> bool:
        if pre is None:
            return True
        kind = pre.get("type")
        if kind not in _LOSSLESS_PRE or str(pre.get("behavior", "")).lower() == "removed":
            return False
        return all(lossless(p) for p in pre.get("pretokenizers", []))

    if not lossless(cfg.get("pre_tokenizer")):
        return None
    added = cfg.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab = tok.get_vocab(with_added_tokens=False)
    byte_level = '"ByteLevel"' in json.dumps(cfg.get("pre_tokenizer"))
    if byte_level:
        # Each vocabulary character is one input byte; every byte must have its character, or
        # (with no unk token) a byte could vanish from the encoding.
        from tokenizers.pre_tokenizers import ByteLevel

        if not set(ByteLevel.alphabet()) <= vocab.keys():
            return None
        longest = max((len(t) for t in vocab), default=1)
    else:
        if model.get("unk_token") is None:
            return None  # unknown characters would be dropped
        # A vocabulary entry's UTF-8 length covers at least its input (Metaspace's marker is
        # 3 bytes for a 1-byte space); an unknown character is one token of up to 4 bytes.
        longest = max([4, *(len(t.encode("utf-8")) for t in vocab)])
    return max([longest, *(len(str(a.get("content", "")).encode("utf-8")) for a in added)])


def _cut_after_final(text: str, final: dict[str, Any]) -> str:
    """`text` up to the end of the final message's content (its last text part), as Hugging
    Face's continue_final_message cuts it."""
    content = final.get("content")
    if isinstance(content, (list, tuple)):
        parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = parts[-1] if parts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text content to continue")
    tail = content.strip()
    at = text.rfind(tail)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not render the last message's "
                                "content verbatim, so it cannot be continued")
    return text[: at + len(tail)]


def _eos_ids(mcfg: dict[str, Any], gcfg: dict[str, Any]) -> list[int]:
    eos = gcfg.get("eos_token_id", mcfg.get("eos_token_id"))
    return [eos] if isinstance(eos, int) else list(eos or [])


def _generation_defaults(gcfg: dict[str, Any]) -> GenerationDefaults:
    return GenerationDefaults(**{k: gcfg[k] for k in ("temperature", "top_p", "top_k", "min_p")
                                 if isinstance(gcfg.get(k), (int, float)) and not isinstance(gcfg.get(k), bool)})


def _read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    return d if isinstance(d, dict) else {}


def _jinja_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, safe for multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window (context for spacing/merges)
        self.read_offset = 0  # tokens before this have been released as text
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        dec = self.tokenizer.decode_one
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is held back (at the end of generation)."""
        dec = self.tokenizer.decode_one
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset:], self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Feed text deltas; get back the text safe to emit and the stop string that matched."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop  # SGLang's no_stop_trim: keep the matched stop string
        self.held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return delta
        buf = self.held + delta
        first, which = len(buf) + 1, None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and i < first:
                first, which = i, s
        if which is not None:
            self.matched, self.held = which, ""
            return buf[:first + (len(which) if self.include_stop else 0)]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return "" if self.matched is not None else out


def default_model_name(model_dir: str | os.PathLike) -> str:
    return Path(model_dir).name

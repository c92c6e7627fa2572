"""Tokenizer: HF `tokenizers` for text <-> ids, jinja2 chat templates rendered the way
transformers' `apply_chat_template` renders them, and an incremental detokenizer.

The detokenizer exists because a character can span several tokens (byte-level BPE
splits CJK and emoji into byte pieces): streaming each token's own decode would emit
U+FFFD halves. It decodes a small window of recent ids and only emits text once the
window no longer ends inside a character.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The chat template raised (e.g. roles that do not alternate) or is missing."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used to mark assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Same environment as transformers: sandboxed, trim_blocks, lstrip_blocks, loopcontrols."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> ids for one model directory (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special_tokens = {k: _token_text(self.config.get(k))
                               for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template = template
        self._template = compile_chat_template(template) if template else None
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.eos_token_ids = self._special_ids(model_dir)

    def _special_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids = set()
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_tok = self.special_tokens.get("eos_token")
        if eos_tok is not None and self._tok.token_to_id(eos_tok) is not None:
            ids.add(self._tok.token_to_id(eos_tok))
        return tuple(sorted(int(i) for i in ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.special_tokens.get("bos_token")
        if add_special_tokens and self.add_bos and bos is not None:
            bos_id = self._tok.token_to_id(bos)
            if not ids or ids[0] != bos_id:
                ids = [bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the conversation to the prompt text, as HF `apply_chat_template(tokenize=False)`."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        ctx = {k: v for k, v in self.special_tokens.items() if v is not None}
        ctx.update(kwargs)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def continue_final_message(self, messages: list[dict], **kwargs) -> str:
        """The conversation rendered so that the model goes on with the last message's text
        (vLLM's and transformers' `continue_final_message`): rendered without a generation
        prompt and cut right after that text, so the template's end-of-turn marker is gone.
        Whitespace the template trimmed off the text's end stays trimmed; an empty last
        message continues from where its text would begin."""
        content = messages[-1]["content"]
        if not content.strip():
            role = messages[-1]["role"]
            if role != "assistant":
                raise ChatTemplateError(f"cannot continue an empty final {role} message")
            return self.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs)
        text = self.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        at = text.rfind(content.strip())
        if at < 0:
            raise ChatTemplateError("the chat template does not render the final message's text as it is, "
                                    "so the model cannot continue it")
        kept = content.lstrip() if text.startswith(content.lstrip(), at) else content.strip()
        return text[:at + len(kept)]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """Ids of the rendered conversation; special tokens come from the template text itself."""
        kwargs = template_kwargs or {}
        if continue_final_message:
            text = self.continue_final_message(messages, **kwargs)
        else:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of ids into text pieces whose concatenation equals decode(all ids).

    Keeps two offsets into the ids: text is emitted from `read` on, decoded together
    with the ids from `prefix` (so tokenizers whose decode depends on the previous
    token, e.g. SentencePiece's leading space, still decode correctly). Nothing is
    emitted while the window ends inside a UTF-8 character (decode yields U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or not full.startswith(prefix_text):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(prefix_text):]

    def flush(self) -> str:
        """Emit whatever is left (an incomplete character decodes to U+FFFD, as decode does)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):]

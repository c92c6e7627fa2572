"""Tokenizer: chat templates render byte-identically to transformers' apply_chat_template,
and the incremental detokenizer's pieces concatenate to decode(all ids) exactly."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CONVERSATIONS = [
    [{"role": "system", "content": "You are a pirate. Answer in one line."},
     {"role": "user", "content": "Where is the treasure?"},
     {"role": "assistant", "content": "Under the old oak, matey."},
     {"role": "user", "content": "And the map? 地図 🗺️"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "  and 3*3, with spaces\n\nand newlines  "},
     {"role": "assistant", "content": "9"},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "No system message here."}],
]

# A Llama-3 style template: bos_token, trim, loop variables, raise_exception on bad roles.
LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# A template that uses tojson (non-ASCII must stay unescaped, as transformers does) and whitespace control.
TOJSON_STYLE = """{%- for m in messages %}
  {%- if m.role == 'system' %}
<<SYS>>{{ m.content | tojson }}<</SYS>>
  {%- else %}
[{{ m.role | upper }}] {{ m.content }}
  {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def _with_template(src_dir, tmp_path, template):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(src_dir / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((src_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("template", ["model", "llama3", "tojson"])
def test_chat_template_matches_transformers(default_model_dir, tmp_path, template):
    from transformers import AutoTokenizer

    d = default_model_dir if template == "model" else _with_template(
        default_model_dir, tmp_path, LLAMA3_STYLE if template == "llama3" else TOJSON_STYLE)
    ours, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for conv in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(conv, add_generation_prompt=gen)
            assert got.encode() == expected.encode()
            assert ours.encode(got, add_special_tokens=False) == hf(expected, add_special_tokens=False)["input_ids"]


def test_model_template_has_system_turns(default_model):
    """The default template puts each turn in <|im_start|>role ... <|im_end|> blocks."""
    _, _, tok = default_model
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a pirate.")
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 5


def test_template_errors_are_clear(default_model_dir, tmp_path):
    tok = Tokenizer(_with_template(default_model_dir, tmp_path, LLAMA3_STYLE))
    with pytest.raises(ChatTemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}])


CHARS = st.sampled_from(list("abc xyz.,!?\n") + list("日本語中文字東京") + ["😀", "🎉", "👩‍💻", "🇫🇷"] + list("éüñß"))


@settings(max_examples=60, deadline=None)
@given(st.lists(CHARS, min_size=1, max_size=40).map("".join))
def test_incremental_detokenizer_reproduces_decode(default_model, text):
    _, _, tok = default_model
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no broken character is ever emitted


def test_detokenizer_holds_back_partial_characters(default_model):
    """'東' is several byte-level tokens: nothing is emitted until the last of them arrives."""
    _, _, tok = default_model
    ids = tok.encode("東", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["東"]


CONTINUED = [
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "  The answer: 4, and  "}],
]


@pytest.mark.parametrize("template", ["model", "llama3", "tojson"])
def test_continue_final_message_matches_transformers(default_model_dir, tmp_path, template):
    """The last message is left open (no end-of-turn after it) exactly as transformers'
    `continue_final_message` renders it, trimmed spaces and all; an empty last assistant
    message continues from the assistant header."""
    from transformers import AutoTokenizer

    d = default_model_dir if template == "model" else _with_template(
        default_model_dir, tmp_path, LLAMA3_STYLE if template == "llama3" else TOJSON_STYLE)
    ours, hf = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    for conv in CONTINUED:
        expected = hf.apply_chat_template(conv, tokenize=False, continue_final_message=True)
        assert ours.continue_final_message(conv) == expected
        assert ours.encode_chat(conv, False, continue_final_message=True) == \
            hf(expected, add_special_tokens=False)["input_ids"]
    empty = [CONTINUED[0][0], {"role": "assistant", "content": ""}]
    assert ours.continue_final_message(empty) == ours.apply_chat_template(empty[:1], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="empty final user"):
        ours.continue_final_message([{"role": "user", "content": " "}])


def test_template_variables_that_break_the_template_are_the_clients_400(default_model_dir, tmp_path):
    """chat_template_kwargs reach the template: one that replaces the template's
    `raise_exception` with a number makes its call on a tool message a TypeError (not a
    template error), which the server answers with a 400 naming the field, not a 500."""
    from types import SimpleNamespace

    from jaxserve.engine.limits import RequestLimits
    from jaxserve.serving import protocol as P
    from jaxserve.serving.app import plan_choices

    served = SimpleNamespace(tokenizer=Tokenizer(_with_template(default_model_dir, tmp_path, LLAMA3_STYLE)),
                             limits=RequestLimits(vocab_size=49152, max_model_len=512, pool_tokens=4096))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ok = plan_choices(served, P.parse_generation({**body, "chat_template_kwargs": {"bos_token": "<s>"}}, chat=True,
                                                 max_n=1))
    assert served.tokenizer.decode(ok[0][0].prompt_ids).startswith("<s><|start_header_id|>")
    tool = {**body, "messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    with pytest.raises(P.APIError) as e:
        plan_choices(served, P.parse_generation({**tool, "chat_template_kwargs": {"raise_exception": 3}}, chat=True,
                                                max_n=1))
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


# Documents rendered before the conversation, as a retrieval-augmented template does.
DOCUMENTS_STYLE = ("{% if documents %}<docs>{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}</docs>"
                   "{% endif %}" + LLAMA3_STYLE)


def test_documents_reach_the_template_and_bad_ones_are_the_clients_400(default_model_dir, tmp_path):
    """vLLM's `documents` are the template's `documents`; with none (or with the default model's
    template, which reads none) the prompt is the conversation's alone."""
    from types import SimpleNamespace

    from jaxserve.engine.limits import RequestLimits
    from jaxserve.serving import protocol as P
    from jaxserve.serving.app import plan_choices

    limits = RequestLimits(vocab_size=49152, max_model_len=512, pool_tokens=4096)
    rag = SimpleNamespace(tokenizer=Tokenizer(_with_template(default_model_dir, tmp_path, DOCUMENTS_STYLE)),
                          limits=limits)
    plain = SimpleNamespace(tokenizer=Tokenizer(default_model_dir), limits=limits)
    body = {"messages": [{"role": "user", "content": "Where is the lantern?"}], "max_tokens": 4}
    docs = [{"title": "Inventory", "text": "The lantern is in the shed."}, {"title": "Note", "text": "Bring oil."}]

    def prompt(served, body):
        return served.tokenizer.decode(plan_choices(served, P.parse_generation(body, chat=True, max_n=1))[0][0].prompt_ids)

    with_docs = prompt(rag, {**body, "documents": docs})
    assert with_docs.startswith("<docs>[Inventory] The lantern is in the shed.\n[Note] Bring oil.\n</docs>")
    assert with_docs.endswith(prompt(rag, body)) and prompt(rag, body) == prompt(rag, {**body, "documents": []})
    assert prompt(plain, {**body, "documents": docs}) == prompt(plain, body)
    for bad in ("The lantern is in the shed.", [["Inventory", "The lantern"]], [{"title": "Inventory", "page": 3}]):
        with pytest.raises(P.APIError) as e:
            P.parse_generation({**body, "documents": bad}, chat=True, max_n=1)
        assert e.value.status == 400 and e.value.param == "documents", bad
    with pytest.raises(P.APIError) as e:
        P.parse_generation({**body, "documents": docs, "chat_template_kwargs": {"documents": []}}, chat=True, max_n=1)
    assert e.value.status == 400 and e.value.param == "documents" and "twice" in e.value.message

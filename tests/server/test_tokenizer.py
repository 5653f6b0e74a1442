import json

import pytest

from glm53.server.embedded_model import EOS_TOKENS, SPECIAL_TOKENS
from glm53.server.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStringMatcher, Tokenizer


def test_embedded_tokenizer_and_specials(model_dir):
    t = Tokenizer.from_dir(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert t.eos_token_ids == cfg["eos_token_id"] == [t.token_to_id(s) for s in EOS_TOKENS]
    assert t.vocab_size == cfg["vocab_size"] >= t.tok.get_vocab_size()
    for tok, special in SPECIAL_TOKENS:
        i = t.token_to_id(tok)
        assert i is not None and t.encode(tok) == [i]
        assert (i in t.special_ids) == special
    text = "def f(x):\n    return x  # Grüße, 世界 🌍"
    assert t.decode(t.encode(text)) == text
    assert t.defaults.temperature == 1.0 and t.defaults.top_p == 0.95


def test_chat_template(model_dir):
    t = Tokenizer.from_dir(model_dir)
    s = t.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                               {"role": "assistant", "content": "A", "reasoning_content": "R"},
                               {"role": "user", "content": [{"type": "text", "text": "V"}]}])
    assert s == "[gMASK]<sop><|system|>S<|user|>U<|assistant|><think>R</think>A<|user|>V<|assistant|><think>"
    s = t.apply_chat_template([{"role": "user", "content": "U"}], enable_thinking=False)
    assert s.endswith("<|user|>U<|assistant|></think>")
    ids = t.encode(s)
    assert ids[:2] == [t.token_to_id("[gMASK]"), t.token_to_id("<sop>")]
    s = t.apply_chat_template([{"role": "user", "content": "U"}],
                              tools=[{"type": "function", "function": {"name": "get_time", "parameters": {}}}])
    assert "<tools>" in s and '"get_time"' in s


def test_continue_final_message(model_dir):
    # Hugging Face's cut: the prompt ends at the last message's (stripped) content, its end of
    # turn and any generation prompt gone, so the answer continues the assistant's text.
    t = Tokenizer.from_dir(model_dir)
    m = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "def f(x):\n    return "}]
    s = t.apply_chat_template(m, add_generation_prompt=False, continue_final_message=True)
    assert s == "[gMASK]<sop><|user|>U<|assistant|></think>def f(x):\n    return"
    parts = [{"role": "user", "content": "U"}, {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                                                  {"type": "text", "text": "B"}]}]
    assert t.apply_chat_template(parts, add_generation_prompt=False, continue_final_message=True).endswith("AB")
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        t.apply_chat_template([{"role": "user", "content": "U"}, {"role": "assistant", "content": ""}],
                              add_generation_prompt=False, continue_final_message=True)


def test_chat_template_from_tokenizer_config(model_dir, tmp_path):
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((model_dir / f).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"


def test_incremental_detokenizer_multibyte(model_dir):
    t = Tokenizer.from_dir(model_dir)
    text = "naïve café — 東京タワー 🎉🎉 done <think>x</think>"
    ids = t.encode(text)
    d = IncrementalDetokenizer(t, skip_special_tokens=False)
    deltas = [d.add([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    # byte tokens of one emoji arrive one at a time: nothing is released until it is complete
    emoji = t.encode("🎉")
    if len(emoji) > 1:
        d = IncrementalDetokenizer(t)
        assert d.add(emoji[:1]) == ""
        assert d.add(emoji[1:]) == "🎉"


def test_stop_strings():
    m = StopStringMatcher(["STOP", "\n\n"])
    out = [m.feed(x) for x in ["hello S", "T", "OP world"]]
    assert "".join(out) == "hello " and m.matched == "STOP"
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == "a " and m.feed("x") == "STx" and m.flush() == "" and m.matched is None
    m = StopStringMatcher(["END"])
    assert m.feed("abcEN") == "abc" and m.flush() == "EN"
    m = StopStringMatcher(["ab", "b"])
    assert m.feed("xab") == "x" and m.matched == "ab"
    m = StopStringMatcher(["END"], include_stop=True)
    assert m.feed("abcEND more") == "abcEND"


def test_min_tokens_is_a_certain_lower_bound(model_dir, tmp_path):
    import random

    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    t = Tokenizer.from_dir(model_dir)
    assert t.max_token_bytes == 64  # the embedded vocabulary's longest entry (64 '#')
    rng = random.Random(0)
    specials = [s for s, _ in SPECIAL_TOKENS]
    pieces = ["#" * 64, " " * 200, "\n" + " " * 47, "é", "世界", "🌍", "def ", "\x00", *specials]
    texts = ["", "x", "#" * 6400, " " * 10_000, "".join(specials) * 50]
    for _ in range(300):
        texts.append("".join(rng.choice(pieces) if rng.random() < 0.5 else chr(rng.randrange(32, 0x2FFF))
                             for _ in range(rng.randrange(1, 400))))
    for text in texts:
        assert t.min_tokens(text) <= len(t.encode(text)), text[:80]
    assert t.min_tokens("#" * 6400) == len(t.encode("#" * 6400)) == 100  # tight on the longest entry
    # A pre-tokenizer that drops whitespace gives no certain bound.
    hf = HFTokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    t2 = Tokenizer.from_dir(tmp_path)
    assert t2.max_token_bytes is None and t2.min_tokens("a " * 1000) == 0

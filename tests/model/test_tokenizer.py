"""The checkpoint's tokenizer and chat template; the converted-GGUF tokenizer cache."""

from __future__ import annotations

from pathlib import Path

from splitserve.model.tokenizer import LightTokenizer, Tokenizer, gguf_fingerprint

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé ✓", "def f(x):\n    return x * 2\n"]


def test_gguf_tokenizer_roundtrip_and_template(smol_tokenizer):
    for text in TEXTS:
        ids = smol_tokenizer.encode(text)
        assert smol_tokenizer.decode(ids) == text
    ids = smol_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    rendered = smol_tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert 2 in smol_tokenizer.eos_token_ids  # <|im_end|>


def test_incremental_decoding_matches_full_decode(smol_tokenizer):
    ids = smol_tokenizer.encode("Streaming ünïcödé ✓ text, token by token.")
    stream = smol_tokenizer.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == stream.text == smol_tokenizer.decode(ids)


def test_converted_tokenizer_is_cached_and_rebuilt_when_corrupt(default_path, tmp_path, monkeypatch):
    """A cache entry whose tokenizer.json is corrupt is converted again (the one conversion here: seconds)
    and replaced; the next load reads the entry, converting nothing, with the same ids."""
    key = gguf_fingerprint(Path(default_path))  # from the weight cache's memo, before the cache dir moves
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    entry = tmp_path / "tokenizers" / key
    entry.mkdir(parents=True)  # an entry whose tokenizer.json is broken
    (entry / "tokenizer_config.json").write_text("{}")
    (entry / "tokenizer.json").write_text("{ not json")
    rebuilt = Tokenizer.from_checkpoint(default_path, cache_key=key)
    assert not isinstance(rebuilt, LightTokenizer)  # converted from the GGUF, not read from the entry
    assert (entry / "tokenizer.json").read_text().startswith("{\n")
    cached = Tokenizer.from_checkpoint(default_path, cache_key=key)
    assert isinstance(cached, LightTokenizer) and cached.folder == entry  # read from the entry
    for text in TEXTS:
        assert cached.encode(text) == rebuilt.encode(text)


def _reference(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_light_tokenizer_matches_transformers_token_for_token() -> None:
    """What the router and the front ends load (tokenizers + jinja2, no transformers) gives transformers'
    ids and text for the same files: plain text, special tokens, the chat template with a generation
    prompt, a continued final message, tools and caller variables in a template of the request's."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from splitserve.model.tokenizer import load_tokenizer

    light = load_tokenizer(None)
    assert isinstance(light, LightTokenizer)
    hf = AutoTokenizer.from_pretrained(str(light.folder))
    texts = [*TEXTS, "<|im_start|>user hi<|im_end|>", "Hello , world . isn 't"]
    for text in texts:
        assert light.encode(text) == hf.encode(text)
        assert light.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        ids = hf.encode(text)
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert [light.token_text(i) for i in ids] == [hf.decode([i]) for i in ids]
    assert light.eos_token_ids == (hf.eos_token_id,) and light.vocab_size == len(hf)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    for gen in (True, False):
        assert light.apply_chat_template(chat, add_generation_prompt=gen) == _reference(
            hf, chat, add_generation_prompt=gen
        )
    cont = [*chat, {"role": "assistant", "content": "The capital is "}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    assert light.apply_chat_template(cont, **kw) == _reference(hf, cont, **kw)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}{{ bos_token }}{{ extra }}"
    )
    kw = {"add_generation_prompt": True, "tools": tools, "chat_template": template, "extra": "é<x>"}
    assert light.apply_chat_template(chat, **kw) == _reference(hf, chat, **kw)
    # and loading it imports neither transformers nor torch
    code = (
        "import sys; from splitserve.model.tokenizer import load_tokenizer; load_tokenizer(None); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

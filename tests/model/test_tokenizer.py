"""The checkpoint's tokenizer and chat template; the converted-GGUF tokenizer cache."""

from __future__ import annotations

from splitserve.model.checkpoint import open_checkpoint
from splitserve.model.tokenizer import Tokenizer

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
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    key = open_checkpoint(default_path).fingerprint()
    fresh = Tokenizer.from_checkpoint(default_path, cache_key=key)
    entry = tmp_path / "tokenizers" / key
    assert (entry / "tokenizer.json").exists()
    cached = Tokenizer.from_checkpoint(default_path, cache_key=key)
    for text in TEXTS:
        assert cached.encode(text) == fresh.encode(text)
    (entry / "tokenizer.json").write_text("{ not json")
    rebuilt = Tokenizer.from_checkpoint(default_path, cache_key=key)
    assert rebuilt.encode(TEXTS[0]) == fresh.encode(TEXTS[0])
    assert (entry / "tokenizer.json").read_text().startswith("{\n")

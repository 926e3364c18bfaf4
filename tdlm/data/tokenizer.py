"""Tokenizers and chat templates.

Real checkpoints ship their tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a chat
template); :func:`load_tokenizer` loads it with ``transformers.AutoTokenizer`` from the local folder,
never from the network. The tiny presets use :func:`build_toy_tokenizer`: a character-level tokenizer
built locally with the ``tokenizers`` library, with the same special-token layout the presets'
configs use (0 pad, 1 eos, 2 mask, ...) and a small chat template, so that prompts for presets and for
Instruct releases go through the same ``apply_chat_template`` call.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from tdlm.errors import TDLMError

TOY_SPECIALS = ["<|pad|>", "<|eos|>", "<|mask|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|eot|>", "<|unk|>"]
TOY_CHARS = "\n" + "".join(c for c in string.printable if c not in "\t\r\x0b\x0c\n")
TOY_VOCAB_SIZE = 128
TOY_CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] + '<|eot|>' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + '<|eot|>' }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_toy_tokenizer():
    """Character-level ``PreTrainedTokenizerFast`` for the toy presets (vocabulary 128)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOY_SPECIALS)}
    for c in TOY_CHARS:
        vocab[c] = len(vocab)
    while len(vocab) < TOY_VOCAB_SIZE:
        vocab[f"<|reserved_{len(vocab)}|>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(TOY_SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|eos|>",
        mask_token="<|mask|>",
        bos_token="<|bos|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|eot|>"],
    )
    tok.chat_template = TOY_CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def load_tokenizer(name_or_path: str):
    """Tokenizer for a backbone preset name or checkpoint folder (local files only)."""
    from tdlm.models.loading import PRESETS, _resolve_folder

    if name_or_path in PRESETS:
        return build_toy_tokenizer()
    folder = _resolve_folder(name_or_path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise TDLMError(f"{folder}: no tokenizer files (expected tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json, and transformers warns that it does not know model_type "llada"
    # (our backbones are native, not transformers classes): noise in every log, so muted for this call.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    finally:
        hf_logging.set_verbosity(level)
    tok.padding_side = "left"
    return tok


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids of user prompts, through the tokenizer's chat template when it has one."""
    out: list[list[int]] = []
    for text in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        out.append([int(i) for i in ids])
    return out


def stop_token_ids(tokenizer, eos_token_id: int) -> set[int]:
    """Ids that end a response: the backbone's EOS plus the chat end-of-turn token if known."""
    ids = {int(eos_token_id)}
    if tokenizer is None:
        return ids
    for name in ("<|eot_id|>", "<|eot|>", "<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return ids

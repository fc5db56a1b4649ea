"""A character-level tokenizer saved as a Hugging Face tokenizer (tokenizer.json).

One token per character of the alphabet plus `<pad>` and `<eos>`: with the Countdown
alphabet that is 21 tokens. A BPE model with no merges splits any string into its
characters; the Fuse decoder joins them back without spaces.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tether.errors import InputError

PAD, EOS = "<pad>", "<eos>"


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A tokenizer with ids 0 = pad, 1 = eos, then one id per character of `alphabet`."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def encode_exact(tokenizer: PreTrainedTokenizerBase, text: str, what: str = "prompt") -> list[int]:
    """Token ids of `text`, refusing text the tokenizer cannot represent exactly.

    A character tokenizer silently drops characters it does not know; a prompt that does
    not survive the round trip would train the model on something other than the task.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != text:
        raise InputError(
            f"{what} {text[:80]!r} does not round-trip through the tokenizer "
            f"(decoded as {back[:80]!r}): it holds characters outside the vocabulary"
        )
    return ids

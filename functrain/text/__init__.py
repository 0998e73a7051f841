"""Text: tokenizers, text inputs for token stores, chat data and decoding (sampling from a language model)."""

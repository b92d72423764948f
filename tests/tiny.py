"""The tiny models the tests build (starsd.models.tiny), under the name the tests import."""

from starsd.models.tiny import (CHAT_TEMPLATE, VOCAB, char_tokenizer, perturbed, save,  # noqa: F401
                                save_pair, tiny_model)

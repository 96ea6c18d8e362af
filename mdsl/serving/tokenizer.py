"""A checkpoint's tokenizer.json through the `tokenizers` package (the optional `text` extra)."""
from __future__ import annotations

import os
from typing import Optional

from mdsl.serving.params import ServingError

INSTALL_HINT = "pip install 'mdsl[text]' (the tokenizers package), or pass prompts as token ids"


class Tokenizer:
    """Loaded on first use; `encode` raises a ServingError saying why text cannot be encoded."""

    def __init__(self, folder: str):
        self.folder = folder
        self._loaded = None
        self._why: Optional[ServingError] = None
        self._tried = False

    def _load(self):
        if not self._tried:
            self._tried = True
            path = os.path.join(self.folder, "tokenizer.json")
            try:
                from tokenizers import Tokenizer as HfTokenizer
            except ImportError:
                self._why = ServingError("text prompts need the tokenizers package, which is not installed",
                                         hint=INSTALL_HINT)
                return None
            if not os.path.exists(path):
                self._why = ServingError(f"the checkpoint {self.folder} has no tokenizer.json",
                                         hint="copy the model's tokenizer.json into the folder, or pass prompts as "
                                              "token ids")
                return None
            try:
                self._loaded = HfTokenizer.from_file(path)
            except Exception as e:   # the library's own exception type is not exported
                self._why = ServingError(f"{path} could not be read: {e}",
                                         hint="use the tokenizer.json that came with the model")
        return self._loaded

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple:
        """The ids of `text`; `add_special_tokens=False` leaves out what the tokenizer's post-processor adds
        (a BOS): for text that spells its special tokens itself, as a rendered chat template does."""
        tok = self._load()
        if tok is None:
            raise ServingError(self._why.message, hint=self._why.hint)
        return tuple(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids) -> Optional[str]:
        """The text of `ids`, or None without a tokenizer."""
        tok = self._load()
        return None if tok is None else tok.decode(list(ids))

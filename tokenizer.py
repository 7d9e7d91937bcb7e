"""The checkpoint's tokenizer: tokenizer.json through the `tokenizers` library, its chat
template through jinja2 (the engine the templates are written for), and streaming decode."""
import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos: str | None, eos: str | None, chat_template: str | None, stop_ids):
        self.tok = tok
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = tok.token_to_id(bos) if bos else None
        self.chat_template = chat_template
        self.stop_ids = tuple(stop_ids)

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")

        def token_str(v):  # tokenizer_config writes special tokens as strings or {"content": ...}
            return v.get("content") if isinstance(v, dict) else v

        bos, eos = token_str(cfg.get("bos_token")), token_str(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        # Stop on every end token any of the three files names (Llama-3 has several).
        stop = [tok.token_to_id(eos)] if eos and tok.token_to_id(eos) is not None else []
        for name in ("generation_config.json", "config.json"):
            stop += _ids(_read_json(path / name).get("eos_token_id"))
        return cls(tok, bos, eos, template, dict.fromkeys(stop))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def identity(self) -> str:
        """What its token ids mean, in a line: the vocabulary's size and a hash of its (token, id)
        pairs. A saved drafts.Memory carries it, and a tokenizer of another identity refuses it."""
        import hashlib
        pairs = json.dumps(sorted(self.tok.get_vocab(with_added_tokens=True).items()), ensure_ascii=False)
        return f"{self.vocab_size} tokens, sha256 {hashlib.sha256(pairs.encode()).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        # The post-processor adds BOS where the model wants one. A chat template already renders
        # BOS as text, and two BOS tokens would change the model's output, so keep only one.
        ids = self.tok.encode(text).ids
        if self.bos_id is not None and ids[:2] == [self.bos_id, self.bos_id]:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render messages with the checkpoint's chat template and the assistant's generation prompt."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (use a plain prompt, without --chat)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class TextStream:
    """Turns token ids, as they are committed, into printable text.

    Decoding one token at a time breaks on two things: a character split over several byte
    tokens (decodes to U+FFFD until complete) and tokenizers that drop a word's leading space
    when it starts the decoded string. So decode a short run of already-printed tokens as
    context together with the new ones, and print only the text beyond that context, once
    it no longer ends in a partial character.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context run
        self.read = 0  # ids before this have been printed

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        context = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(context):]

    def flush(self) -> str:
        """What is left at the end (a truly broken byte sequence prints as U+FFFD)."""
        context = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(context):]

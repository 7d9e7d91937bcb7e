"""Lookahead decoding inside transformers' generate: the engine (engine.py: the pool, the window,
the trie, verification, commit, the draft sources, the dynamic shape, sampling) driven through a
model transformers loaded, instead of model.py's.

    from hf_backend import lookahead_generate
    out = model.generate(**inputs, max_new_tokens=64, custom_generate=lookahead_generate)

(or custom_generate="path/to/this/repository" with trust_remote_code=True: custom_generate/).

The engine asks a model for little: a step's forward over its tokens at their positions under
its mask, the logits at the positions it reads, and a KV cache it can roll back. TransformersModel
gives exactly that over a transformers model:

    step    input_ids (1, T), position_ids (1, T) = C + offsets, a 4-D additive mask (1, 1, T, C+T)
            (the committed slots, then the step's own mask; a dict of two where some layers
            slide: a sliding layer's keys only within its window), logits_to_keep = the read
    cache   a DynamicCache of full layers: slot s holds position s. Before a step the previous
            step's roll back moves the accepted K/V next to `last`'s in every layer (the same
            moves as the engine's, cache.move_kv) and the rest is cropped at C

Of the decoder's files only this one imports transformers: the project's own path runs
without it. One sequence at a time (a batch is refused), eager or sdpa attention (they take any
4-D mask), and only models whose layers are full or sliding attention: a recurrent or
linear-attention layer keeps a state that cannot be rolled back, and is refused before the first
step, as are RoPE that follows the sequence's length (longrope, dynamic), a static cache, flash
or flex attention, and generation options the engine does not carry out.
"""
import inspect
import weakref
from types import SimpleNamespace

import torch
from transformers import DynamicCache
from transformers.generation import (EosTokenCriteria, GenerateDecoderOnlyOutput, MaxLengthCriteria,
                                     TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import engine
from cache import move_kv

ATTENTION = ("eager", "sdpa")  # the implementations that take a prepared 4-D mask as it is
LAYERS = ("full_attention", "sliding_attention")  # the layers whose cache rolls back by moves and a crop


def refusal(hf) -> str | None:
    """Why this transformers model cannot run here (one line), or None."""
    config = getattr(hf, "config", None)
    if config is None or not hasattr(hf, "get_input_embeddings"):
        return f"{type(hf).__name__} is not a transformers model"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(hf).__name__} is an encoder-decoder model; lookahead here decodes decoder-only models"
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - set(LAYERS)
    if kinds:
        return (f"{type(hf).__name__} has {', '.join(sorted(kinds))} layers: their state cannot be rolled back "
                f"to the accepted tokens (only {' and '.join(LAYERS)} layers can)")
    rope = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}).get("rope_type")
    if rope in ("longrope", "dynamic"):  # (a dict a layer kind, as Gemma 3 keeps, has no rope_type of its own)
        return (f"rope_type {rope!r} picks its frequencies from the sequence's length, which a step's guessed "
                "tokens would change: not supported here (model.py runs Phi-3's longrope)")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTION:
        return (f"attn_implementation={attention!r} cannot take lookahead's tree mask; load the model with "
                f"attn_implementation='sdpa' or 'eager'")
    if "position_ids" not in inspect.signature(hf.forward).parameters:
        return f"{type(hf).__name__}.forward takes no position_ids: lookahead's tokens need positions of their own"
    return None


class TransformersCache:
    """The engine's view of the cache (cache.KVCache's slots, rows, setup, rollback) over a
    DynamicCache whose layers are all full: slot s of a layer holds position s."""

    def __init__(self, context: int):
        self.context, self.slots, self.rows, self.kv = context, 0, 0, DynamicCache()

    def setup(self, slots: int, rows: int = 1, spare: bool = False):
        if rows != 1:
            raise ValueError("the transformers backend decodes one sequence at a time")
        self.slots, self.rows, self.kv = self.context, 1, DynamicCache()  # grows as it is written

    def layers(self):
        return [layer for layer in self.kv.layers if layer.is_initialized]

    def rollback(self, moves: list[list[tuple[int, int]]]):
        """Move row 0's K/V from slot `from` to slot `to` in every layer, now."""
        if moves[0]:
            pairs = torch.tensor(moves[0], device=self.layers()[0].keys.device)  # (M, 2)
            self.move(pairs[:, 0][None], pairs[:, 1][None])

    def move(self, moves_from, moves_to):
        rows = torch.zeros(1, 1, dtype=torch.long, device=moves_from.device)
        for layer in self.layers():
            move_kv(layer.keys, rows, moves_from.to(layer.keys.device), moves_to.to(layer.keys.device))
            move_kv(layer.values, rows, moves_from.to(layer.values.device), moves_to.to(layer.values.device))

    def crop(self, C: int):
        """Keep slots [0, C): what the next forward's tokens come after."""
        for layer in self.layers():
            layer.keys, layer.values = layer.keys[:, :, :C], layer.values[:, :, :C]

    def keep_rows(self, rows, used):
        raise ValueError("the transformers backend decodes one sequence at a time")


class TransformersModel:
    """A transformers causal LM with the interface the engine decodes through (model.Transformer's
    step, its prefill call and its cache). The model's own weights and modules run unchanged."""

    def __init__(self, hf):
        why = refusal(hf)
        if why:
            raise ValueError(why)
        self.hf, text = hf, hf.config.get_text_config()
        context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 1 << 20
        self.args = SimpleNamespace(vocab_size=text.vocab_size, max_seq_len=context, rope_scaling=None)
        # Each kind of layer's window (None: full). A config without layer_types slides every
        # layer where it names a window (Mistral, Phi-3), as the model's own mask does.
        kinds = getattr(text, "layer_types", None) or (
            "sliding_attention" if getattr(text, "sliding_window", None) else "full_attention",)
        self.windows = {kind: text.sliding_window if kind == "sliding_attention" else None for kind in set(kinds)}
        self.cache, self.compiled = TransformersCache(context), None
        takes = inspect.signature(hf.forward).parameters
        self.cache_keyword = "cache" if "cache" in takes else "past_key_values"  # (transformers renamed it)
        self.keeps_logits = "logits_to_keep" in takes

    @property
    def device(self):  # where the inputs go: the embedding's device (a model spread by device_map too)
        return self.hf.get_input_embeddings().weight.device

    @property
    def dtype(self):
        return self.hf.get_input_embeddings().weight.dtype

    def masks(self, positions, C: int, mask):
        """The additive 4-D mask (1, 1, T, C+T) the model adds to its attention scores: the C
        committed slots (slot s at position s), then the step's mask (None: causal); one for each
        kind of layer, a sliding one's keys only within its window of each query."""
        T, dev = positions.shape[-1], positions.device
        keys = torch.cat((torch.arange(C, device=dev), positions[0]))  # (C+T,) each key's position
        own = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev)) if mask is None else mask[0].to(dev)
        allowed = torch.cat((torch.ones(T, C, dtype=torch.bool, device=dev), own), dim=1)  # (T, C+T)
        out = {}
        for kind, window in self.windows.items():
            seen = allowed if window is None else allowed & (positions[0][:, None] - keys[None, :] < window)
            out[kind] = torch.zeros(seen.shape, dtype=self.dtype, device=dev).masked_fill(
                ~seen, torch.finfo(self.dtype).min)[None, None]
        return out if len(out) > 1 else next(iter(out.values()))

    def forward(self, tokens, positions, C: int, mask=None, read=None):
        """Logits (1, R, V) at `read` (all T positions if None) of tokens (1, T) written after slot C."""
        self.cache.crop(C)
        keep = 0 if read is None else read.reshape(-1).to(self.device)
        positions = positions.to(self.device)
        kwargs = {self.cache_keyword: self.cache.kv}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        out = self.hf(input_ids=tokens.to(self.device), position_ids=positions, use_cache=True,
                      attention_mask=self.masks(positions, C, mask), **kwargs)
        return out.logits if self.keeps_logits or read is None else out.logits[:, keep]

    def __call__(self, tokens, positions=None, committed=None, mask=None, committed_range=None, read=None,
                 cache_row=None, prompt_end=None, check=True, head=True, moves=None):
        """decoding.run_prompt's call: a prompt's chunk after slot committed_range[0], causal.
        head=False: the logits of every position, which lm_head then passes on as they are (the
        prefill that reads the model's rankings after every prompt token)."""
        positions = positions.reshape(1, -1)
        logits = self.forward(tokens, positions, committed_range[0], mask, read if head else None)
        return logits if head else logits[0]

    def lm_head(self, logits):
        return logits

    def step(self, tokens, positions, committed, mask, committed_range, read=None, moves=None):
        """engine.batch_step's forward: the step before's roll back first, then this step."""
        if moves is not None:
            self.cache.move(moves[:, 0].to(self.device), moves[:, 1].to(self.device))
        return self.forward(tokens, positions, committed_range[0], mask, read)


ADAPTERS = weakref.WeakKeyDictionary()  # one per transformers model: the dynamic shape's costs are kept on it


def adapter(hf) -> TransformersModel:
    out = ADAPTERS.get(hf)
    if out is None:
        out = ADAPTERS[hf] = TransformersModel(hf)
    return out


def sampling_options(config, logits_processor) -> dict:
    """generate's sampling settings as the engine's (temperature, top_k, top_p); one line for
    any logits processor the engine does not carry out."""
    allowed = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper) if config.do_sample else ()
    for processor in logits_processor or ():
        if not isinstance(processor, allowed):
            raise ValueError(f"lookahead carries out do_sample, temperature, top_k and top_p; not "
                             f"{type(processor).__name__} (remove the option that adds it)")
    if not config.do_sample:
        return {}
    return dict(temperature=config.temperature or 1.0, top_k=config.top_k or 0,
                top_p=1.0 if config.top_p is None else config.top_p)


@torch.no_grad()
def lookahead_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                       synced_gpus=False, streamer=None, window=None, ngram=None, candidates=None, drafts=None,
                       seed=0, **model_kwargs):
    """generate's decoding loop for `custom_generate=`: lookahead decoding through the engine.
    window, ngram, candidates: the paper's fixed shape W, N, G (none of them: the dynamic shape);
    drafts: engine.generate's draft sources; seed: sampling's and the window's. Returns what
    generate returns: the ids (1, prompt + new), or a GenerateDecoderOnlyOutput of them where
    return_dict_in_generate. transformers (5.x) hands a callable no streamer: bind one with
    functools.partial(lookahead_generate, streamer=...) or use the folder form, which does."""
    config = generation_config
    if config.num_beams != 1 or config.num_return_sequences != 1:
        raise ValueError("lookahead decodes one sequence: num_beams and num_return_sequences must be 1")
    if input_ids.shape[0] != 1:
        raise ValueError(f"a batch of {input_ids.shape[0]} prompts: the transformers backend decodes one "
                         "sequence at a time")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("the prompt is padded (attention_mask has zeros): pass it unpadded")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and (type(cache) is not DynamicCache or cache.get_seq_length()):
        raise ValueError(f"lookahead keeps a DynamicCache of its own; got a {type(cache).__name__}"
                         f"{' holding tokens' if type(cache) is DynamicCache else ''} (leave cache_implementation "
                         "and past_key_values unset)")
    if config.output_scores or config.output_logits or config.output_attentions or config.output_hidden_states:
        raise ValueError("lookahead returns the sequences only: output_scores, output_logits, output_attentions "
                         "and output_hidden_states are not kept")
    for criterion in stopping_criteria or ():
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            raise ValueError(f"lookahead stops at max_new_tokens and eos_token_id; not {type(criterion).__name__}")
    options = sampling_options(config, logits_processor)
    prompt = input_ids[0].tolist()
    max_new = config.max_length - len(prompt)
    if max_new < 1:
        raise ValueError(f"max_length {config.max_length} leaves no room after the prompt of {len(prompt)} tokens")
    eos = config.eos_token_id
    stop = () if eos is None else (eos.tolist() if torch.is_tensor(eos) else [eos] if isinstance(eos, int) else eos)
    on_tokens = streamer and (lambda ids: streamer.put(torch.tensor(ids)))
    out = engine.generate(adapter(model), prompt, max_new, window=window, ngram=ngram, candidates=candidates,
                          stop_ids=list(stop), drafts=drafts, seed=seed, on_tokens=on_tokens, **options)
    streamer and streamer.end()
    sequences = torch.tensor([prompt + out.tokens], device=input_ids.device)
    return GenerateDecoderOnlyOutput(sequences=sequences) if config.return_dict_in_generate else sequences

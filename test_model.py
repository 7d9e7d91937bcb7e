"""model.py and tokenizer.py: loading, the positions/slots/mask forward, the cache, and the
real SmolLM2 checkpoint against Hugging Face transformers' greedy output."""
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_matches_reference, hf_config, random_model, tiny_args, write_checkpoint
from decoding import greedy_decode
from linear import Linear, tune_cpu_products
from model import ModelArgs, Transformer, rope_inv_freq
from tokenizer import TextStream, Tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

VARIANTS = {
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mha": dict(n_heads=4, n_kv_heads=4),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "head_dim": dict(head_dim=16),  # head_dim * n_heads != dim
    "qwen2_bias": dict(attention_bias=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_load_and_match(tmp_path, variant):
    model = random_model(**VARIANTS[variant])
    model_type = "qwen2" if variant == "qwen2_bias" else "llama"
    loaded = Transformer.from_pretrained(write_checkpoint(tmp_path, model, model_type), "cpu", torch.float64)
    assert loaded.args == model.args
    assert loaded.dtype == torch.float64
    tokens = torch.randint(0, 32, (1, 12))
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=1e-12)
    if model.args.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_sharded_checkpoint(tmp_path):
    model = random_model()
    loaded = Transformer.from_pretrained(write_checkpoint(tmp_path, model, shards=3), "cpu", torch.float32)
    assert loaded.dtype == torch.float32
    tokens = torch.randint(0, 32, (1, 9))
    torch.testing.assert_close(loaded(tokens).double(), model(tokens), rtol=0, atol=1e-4)


def test_config_fields():
    cfg = hf_config(tiny_args(), "mistral", eos_token_id=[2, 5], sliding_window=128,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}})
    del cfg["rope_theta"]
    args = ModelArgs.from_hf_config(cfg)
    assert args.eos_ids == (2, 5)
    assert args.rope_theta == 5e5 and args.rope_scaling["rope_type"] == "llama3"
    assert args.max_seq_len == 128  # capped at the sliding window, where full attention is still exact
    old_key = ModelArgs.from_hf_config(hf_config(tiny_args(), rope_scaling={**LLAMA3_ROPE, "type": "llama3"}))
    assert old_key.rope_scaling["factor"] == 8.0
    assert ModelArgs.from_hf_config(hf_config(tiny_args(), "qwen2")).attention_bias
    assert ModelArgs.from_hf_config({k: v for k, v in hf_config(tiny_args()).items()
                                     if k != "num_key_value_heads"}).n_kv_heads == 4


def test_llama3_rope_frequencies():
    # Llama-3 scaling keeps short wavelengths, divides long ones by `factor`, blends between.
    base = rope_inv_freq(tiny_args(head_dim=64, rope_theta=500000.0))
    scaled = rope_inv_freq(tiny_args(head_dim=64, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE))
    wavelen = 2 * torch.pi / base
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(scaled[short], base[short])
    torch.testing.assert_close(scaled[long], base[long] / 8)
    mid = ~short & ~long
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()


def test_incremental_decoding_matches_full_forward():
    model = random_model(seed=1)
    tokens = torch.randint(0, 32, (1, 20))
    full = model(tokens)  # plain causal forward
    model.setup_cache(32)
    idx = torch.arange(20)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    prefix = model(tokens[:, :8], idx[:8], idx[:8], causal[:8, :8])
    steps = [model(tokens[:, t:t + 1], idx[t:t + 1], idx[t:t + 1], causal[t:t + 1, :t + 1]) for t in range(8, 20)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, rtol=0, atol=1e-12)


def tree_step(model, prefix_len):
    """A step over a tree of tokens in scrambled slots: token i extends parent[i] (-1 = the
    cached prefix). Returns tokens, parents, slots and the logits."""
    parents = [-1, 0, 1, -1, 3, 0, 5, 6]
    tokens = torch.randint(0, 32, (1, len(parents)))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    # The first token in the first free slot, as a decoder puts `last`; the others with gaps, in any order.
    slots = prefix_len + torch.cat((torch.zeros(1, dtype=torch.long), 1 + torch.randperm(len(parents) + 3)[:len(parents) - 1]))
    mask = torch.zeros(len(parents), prefix_len + len(parents) + 4, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, slots[j]] = True
            j = parents[j]
    positions = prefix_len + torch.tensor(depth)
    return tokens, parents, slots, model(tokens, positions, slots, mask)


def cached_prefix(model, n, cache_len):
    """Random prefix tokens (1, n), run through a fresh cache of cache_len slots."""
    prefix = torch.randint(0, 32, (1, n))
    model.setup_cache(cache_len)
    idx = torch.arange(n)
    model(prefix, idx, idx, torch.ones(n, n, dtype=torch.bool).tril())
    return prefix


def ancestry(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_f_linear_for_any_token_count(bias):
    # On the CPU, Linear multiplies the counts in `transposed` as (W @ x^T)^T, a single token
    # with a copy added: the copy must never leak into the result, whatever the batch shape.
    torch.manual_seed(0)
    layer = Linear(24, 40, bias=bias).double()
    layer.transposed = frozenset(range(1, 10))
    for n in range(1, 18):
        x = torch.randn(2, n, 24, dtype=torch.float64)
        for inp in (x, x[:1], x[0]):
            torch.testing.assert_close(layer(inp), torch.nn.functional.linear(inp, layer.weight, layer.bias),
                                       rtol=0, atol=1e-12)


def slowed(f, seconds=0.002):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return f(*args, **kwargs)
    return slow


def test_cpu_products_take_the_way_measured_faster_for_every_layer_and_change_no_result(monkeypatch):
    model = random_model(seed=5, vocab_size=64)
    tokens = torch.randint(0, 64, (1, 7))
    before = model(tokens)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1  # 2 layers' qkv, o, gate_up, down; the head
    chosen = tune_cpu_products(linears, (1, 2, 4, 8), 16)  # whatever this CPU measures
    for n in range(1, 17):  # a count follows the next size up that was measured, 9..16 the largest
        assert (n in chosen) == (min([s for s in (1, 2, 4, 8) if s >= n] or [8]) in chosen)
    assert all(m.transposed == chosen for m in linears)
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=1e-12)
    # Made slow, either way loses everywhere: the choice follows the clock, not a constant.
    with monkeypatch.context() as m:
        m.setattr(torch, "mm", slowed(torch.mm))  # (W @ x^T)^T
        assert tune_cpu_products(linears, (1, 2, 4, 8), 16) == frozenset()
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "linear", slowed(torch.nn.functional.linear))  # F.linear
        assert tune_cpu_products(linears, (1, 2, 4, 8), 16) == frozenset(range(1, 17))
    assert all(m.transposed == frozenset(range(1, 17)) for m in linears)
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=1e-12)


def test_scattered_slots_and_mask_equal_plain_forward():
    model = random_model(seed=2)
    prefix = cached_prefix(model, 6, 32)
    tokens, parents, _, logits = tree_step(model, 6)
    for i in range(len(parents)):
        seq = torch.cat([prefix, tokens[:, ancestry(parents, i)]], dim=1)
        torch.testing.assert_close(logits[0, i], model(seq)[0, -1], rtol=0, atol=1e-12)


def test_commit_copies_slots_like_a_fresh_run():
    model = random_model(seed=3)
    prefix = cached_prefix(model, 5, 40)
    tokens, parents, slots, _ = tree_step(model, 5)
    keep = ancestry(parents, 7)  # the path 0 -> 5 -> 6 -> 7 wins
    model.commit([slots[keep].tolist()])  # to slots 5, 6, ... in the path's order

    fresh = random_model(seed=3)
    fresh.setup_cache(40)
    seq = torch.cat([prefix, tokens[:, keep]], dim=1)
    n = seq.shape[1]
    fresh(seq, torch.arange(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    torch.testing.assert_close(model.kv()[..., :n, :], fresh.kv()[..., :n, :], rtol=0, atol=1e-12)


# --- bad checkpoints -------------------------------------------------------------------------

def test_float32_by_default_whatever_the_checkpoint_stores(tmp_path):
    # bfloat16 is opt-in: by default a checkpoint saved in bf16 loads as float32 (exactly greedy).
    folder = write_checkpoint(tmp_path / "bf16", random_model(seed=1).to(torch.bfloat16))
    assert Transformer.from_pretrained(folder, "cpu").dtype == torch.float32
    assert Transformer.from_pretrained(folder, "cpu", torch.bfloat16).dtype == torch.bfloat16


def test_rms_norm_of_a_float64_model_stays_float64():
    model = random_model(seed=1)  # float64
    x = torch.randn(3, model.args.dim, dtype=torch.float64)
    norm = model.norm
    want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(norm(x), want, rtol=0, atol=1e-13)  # float32 rounding would be ~1e-7


def test_the_prefill_builds_no_mask_and_matches_masked_steps(monkeypatch):
    # A prompt's prefill is causal through SDPA's own kernels: no (P, P) mask is ever built, and
    # its cache and logits are those of running the prompt through the masked path.
    from decoding import prefill
    model = random_model(seed=6)
    prompt = [int(t) for t in torch.randint(0, model.args.vocab_size, (40,), generator=torch.Generator().manual_seed(0))]
    model.setup_cache(64)
    idx = torch.arange(40)
    want = model(torch.tensor([prompt]), idx, idx, torch.ones(40, 40, dtype=torch.bool).tril())[:, -1:]
    want_cache = model.kv()[..., :40, :].clone()
    model.setup_cache(64)

    def no_mask(*args):
        raise AssertionError("the prefill built an attention mask")

    monkeypatch.setattr(model, "attention_mask", no_mask)
    got = prefill(model, [prompt])[:, None]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.kv()[..., :40, :], want_cache, rtol=0, atol=1e-12)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Transformer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)


def test_unknown_model_type(tmp_path):
    write_checkpoint(tmp_path, random_model(), config=hf_config(tiny_args(), "gpt2"))
    with pytest.raises(ValueError, match="'gpt2'"):
        Transformer.from_pretrained(tmp_path)


def test_pickle_only_and_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(tiny_args())))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="only safetensors"):
        Transformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["missing", "shape", "unexpected"])
def test_damaged_weights_name_the_tensor(tmp_path, damage):
    model = random_model()
    write_checkpoint(tmp_path, model)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    if damage == "missing":
        del state[name]
    elif damage == "shape":
        state[name] = state[name][:, :-1].contiguous()
    else:
        state["model.layers.1.mlp.extra.weight"] = state[name].clone()
        name = "model.layers.1.mlp.extra.weight"
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=name.removeprefix("model." if damage == "missing" else "")):
        Transformer.from_pretrained(tmp_path)


def test_sharded_checkpoint_with_missing_shard(tmp_path):
    write_checkpoint(tmp_path, random_model(), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        Transformer.from_pretrained(tmp_path)


# --- the real checkpoint ---------------------------------------------------------------------

def test_smollm2_greedy_matches_transformers(smollm2, reference):
    for case in reference:
        gen = greedy_decode(smollm2, case["prompt_ids"], len(case["greedy_ids"]), stop_ids=(2,))
        assert_matches_reference(gen.tokens, case)
        assert gen.steps == len(gen.tokens) - 1


def test_smollm2_tokenizer(smollm2_path, reference):
    tok = Tokenizer.from_pretrained(smollm2_path)
    assert 2 in tok.stop_ids
    for case in reference:
        text = tok.apply_chat_template([{"role": "user", "content": case["prompt"]}]) if case["chat"] else case["prompt"]
        assert tok.encode(text) == case["prompt_ids"]
        assert tok.decode(case["greedy_ids"]) == case["text"]


def test_text_stream_keeps_spaces_and_whole_characters(smollm2_path):
    tok = Tokenizer.from_pretrained(smollm2_path)
    text = "Naïve café: 東京 is big — 🙂 ok!\n  indented"
    ids = tok.encode(text)
    stream, pieces = TextStream(tok), []
    for i in ids:
        piece = stream.push([i])
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces)  # some character did span several tokens


# --- the compiled step ------------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile on the CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled_pair():
    """The same tiny float64 model twice: eager, and with every step size up to 8 compiled."""
    eager = random_model(seed=9, vocab_size=16, max_seq_len=96)
    compiled = random_model(seed=9, vocab_size=16, max_seq_len=96)
    compiled.compile_steps((1, 2, 4, 8))
    return eager, compiled


@needs_compiler
def test_compiled_decoding_equals_eager_and_compiles_nothing_after_the_warm_up(compiled_pair):
    from torch._dynamo.utils import counters
    from decoding import sample_decode
    from lookahead import lookahead_decode
    from shape import StepCosts
    eager, compiled = compiled_pair
    graphs = counters["stats"]["unique_graphs"]
    costs = StepCosts({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.3})  # a fixed cost model: repeatable shapes
    for prompt, n in (([1, 2, 3, 1, 2, 3, 1, 2], 30), ([5, 6, 7, 8, 9] * 3, 41), ([4], 12)):
        runs = [
            lambda m: greedy_decode(m, prompt, n),
            lambda m: lookahead_decode(m, prompt, n, costs=costs),
            lambda m: lookahead_decode(m, prompt, n, 2, 3, 1),  # 7 tokens a step, padded to 8
            lambda m: lookahead_decode(m, prompt, n, 1, 3, 1, temperature=0.9, seed=4),
            lambda m: sample_decode(m, prompt, n, temperature=0.9, seed=4),
        ]
        for run in runs:
            want, got = run(eager), run(compiled)
            assert got.tokens == want.tokens and got.committed == want.committed
            # Padding and the whole-cache attention leave the committed cache as eager's.
            C = len(prompt) + len(want.tokens) - 1
            torch.testing.assert_close(compiled.kv()[..., :C, :], eager.kv()[..., :C, :], rtol=0, atol=1e-10)
    assert counters["stats"]["unique_graphs"] == graphs  # new prompt lengths and lengths: no new graph
    assert any(s.size > 1 + s.guesses + s.window * s.levels
               for s in lookahead_decode(compiled, [1, 2, 3, 1, 2, 3], 30, 2, 3, 1).shapes)  # padding ran


@needs_compiler
def test_a_compiled_model_keeps_its_cache(compiled_pair):
    _, compiled = compiled_pair
    assert compiled.cache_len == 96
    buffers = dict(compiled.named_buffers())  # buffers: their addresses stay fixed for CUDA graphs
    assert all(f"layers.{i}.self_attn.{kv}_cache" in buffers for i in range(2) for kv in "kv")
    with pytest.raises(ValueError, match="compiled"):
        compiled.setup_cache(48)

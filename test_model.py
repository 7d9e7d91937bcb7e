"""model.py and tokenizer.py: loading, the positions/slots/mask forward, the cache, and the
real SmolLM2 checkpoint against Hugging Face transformers' greedy output."""
import json
import math
import re
import shutil
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

import attention
import model as model_py
from conftest import FAMILY_OPTIONS, assert_matches_reference, hf_config, random_model, tiny_args, write_checkpoint
from decoding import greedy_decode
from engine import generate
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
    "qwen2_bias": dict(qkv_bias=True, model_type="qwen2"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_load_and_match(tmp_path, variant):
    model = random_model(**VARIANTS[variant])
    loaded = Transformer.from_pretrained(write_checkpoint(tmp_path, model, model.args.model_type), "cpu", torch.float64)
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
    assert args.max_seq_len == 256 and args.sliding_window == 128 and args.sliding_layers == (0, 1)  # all slide
    old_key = ModelArgs.from_hf_config(hf_config(tiny_args(), rope_scaling={**LLAMA3_ROPE, "type": "llama3"}))
    assert old_key.rope_scaling["factor"] == 8.0
    assert ModelArgs.from_hf_config(hf_config(tiny_args(), "qwen2")).qkv_bias
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


def at(n: int) -> torch.Tensor:
    """committed = n for one row, (1, 1)."""
    return torch.tensor([[n]])


def test_incremental_decoding_matches_full_forward():
    # A prompt in two chunks (the second causal over itself and the first), then one token a step.
    model = random_model(seed=1)
    tokens = torch.randint(0, 32, (1, 20))
    full = model(tokens)  # plain causal forward
    model.cache.setup(32)
    idx = torch.arange(20)
    chunks = [model(tokens[:, :5], idx[:5], at(0)), model(tokens[:, 5:8], idx[5:8], at(5))]
    alone = torch.ones(1, 1, 1, dtype=torch.bool)
    steps = [model(tokens[:, t:t + 1], idx[t:t + 1], at(t), alone) for t in range(8, 20)]
    torch.testing.assert_close(torch.cat([*chunks, *steps], dim=1), full, rtol=0, atol=1e-12)


def tree_step(model, prefix_len):
    """A step over a tree of tokens after a cached prefix: token i extends parent[i] (-1 = the
    cached prefix), in slot prefix_len + i. Returns tokens, parents, slots and the logits."""
    parents = [-1, 0, 1, -1, 3, 0, 5, 6]
    tokens = torch.randint(0, 32, (1, len(parents)))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    block = torch.zeros(1, len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        block[0, i, ancestry(parents, i)] = True
    positions = prefix_len + torch.tensor(depth)
    slots = prefix_len + torch.arange(len(parents))
    return tokens, parents, slots, model(tokens, positions, at(prefix_len), block)


def cached_prefix(model, n, cache_len):
    """Random prefix tokens (1, n), run through a fresh cache of cache_len slots."""
    prefix = torch.randint(0, 32, (1, n))
    model.cache.setup(cache_len)
    model(prefix, torch.arange(n), at(0))
    return prefix


def ancestry(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [40, 2000], ids=["narrow", "wide"])
def test_cpu_linear_equals_f_linear_for_any_token_count(bias, out_features):
    # On the CPU, Linear multiplies the counts in `transposed` as (W @ x^T)^T, a single token
    # with a copy added: the copy must never leak into the result, whatever the batch shape.
    # The wide layer's results are large enough (4,000 values and up) for torch to copy them
    # back through another kernel than the narrow one's.
    torch.manual_seed(0)
    layer = Linear(24, out_features, bias=bias).double()
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


@pytest.mark.parametrize("one_call", [0, attention.ONE_CALL_CPU], ids=["two-calls-merged", "one-call"])
def test_scattered_slots_and_mask_equal_plain_forward(monkeypatch, one_call):
    # A step's own keys in a part of their own, merged with the committed ones' (a GPU, a CPU
    # step past ONE_CALL_CPU), or read with them in one call (a small CPU step): both exact.
    monkeypatch.setattr(attention, "ONE_CALL_CPU", one_call)
    merged = []
    monkeypatch.setattr(model_py, "merge", lambda *parts: merged.append(1) or attention.merge(*parts))
    model = random_model(seed=2)
    prefix = cached_prefix(model, 6, 32)
    tokens, parents, _, logits = tree_step(model, 6)
    assert bool(merged) == (one_call == 0)  # the way asked was the way taken
    for i in range(len(parents)):
        seq = torch.cat([prefix, tokens[:, ancestry(parents, i)]], dim=1)
        torch.testing.assert_close(logits[0, i], model(seq)[0, -1], rtol=0, atol=1e-12)


def test_rollback_moves_slots_like_a_fresh_run():
    model = random_model(seed=3)
    prefix = cached_prefix(model, 5, 40)
    tokens, parents, slots, _ = tree_step(model, 5)
    keep = ancestry(parents, 7)  # the path 0 -> 5 -> 6 -> 7 wins
    model.cache.rollback([[(s, d) for d, s in enumerate(slots[keep].tolist(), start=5)]])  # to 5, 6, ... in order

    fresh = random_model(seed=3)
    fresh.cache.setup(40)
    seq = torch.cat([prefix, tokens[:, keep]], dim=1)
    n = seq.shape[1]
    fresh(seq, torch.arange(n), at(0))
    torch.testing.assert_close(model.cache.kv()[..., :n, :], fresh.cache.kv()[..., :n, :], rtol=0, atol=1e-12)


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


@pytest.mark.parametrize("chunk", [16, 1024])
def test_the_prefill_runs_fused_kernels_in_chunks_and_matches_one_token_steps(monkeypatch, chunk):
    # A prompt's prefill, whole or in chunks each causal over the cache so far, only ever calls
    # fused attention (no (T, S) scores or per-token mask in memory), and gives the cache and
    # logits of running the prompt one token a step.
    import decoding
    model = random_model(seed=6)
    prompt = [int(t) for t in torch.randint(0, model.args.vocab_size, (40,), generator=torch.Generator().manual_seed(0))]
    model.cache.setup(64)
    alone = torch.ones(1, 1, 1, dtype=torch.bool)
    want = [model(torch.tensor([[t]]), at(i)[0], at(i), alone) for i, t in enumerate(prompt)][-1][:, -1]
    want_cache = model.cache.kv()[..., :40, :].clone()
    model.cache.setup(64)

    def no_math(*args):
        raise AssertionError("the prefill built scores in plain math")

    monkeypatch.setattr(model_py, "math_attention", no_math)
    monkeypatch.setattr(decoding, "PREFILL_CHUNK", chunk)
    got = decoding.prefill(model, [prompt])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.cache.kv()[..., :40, :], want_cache, rtol=0, atol=1e-12)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Transformer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)


LONGROPE = dict(type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=64)
REFUSED = {  # what is not built -> (config.json changes, the field named in the error)
    "model_type": (dict(model_type="gpt2"), "model_type = 'gpt2'"),
    "moe_type": (dict(model_type="qwen3_moe"), "model_type = 'qwen3_moe'"),
    "hidden_act": (dict(hidden_act="relu2"), "hidden_act = 'relu2'"),
    "gemma_act": (dict(model_type="gemma3_text", hidden_activation="gelu_new"), "hidden_activation = 'gelu_new'"),
    "rope_yarn": (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type = 'yarn'"),
    "rope_dynamic": (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_type = 'dynamic'"),
    "longrope_factors": (dict(model_type="phi3", rope_scaling=dict(LONGROPE, short_factor=[1.0])), "short_factor"),
    "partial_rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),  # built for Phi-3 alone
    "softcap": (dict(model_type="gemma3_text", final_logit_softcapping=30.0), "final_logit_softcapping = 30.0"),
    "attn_softcap": (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping = 50.0"),
    "experts": (dict(num_local_experts=8), "num_local_experts = 8"),
    "bidirectional": (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    "mistral_bias": (dict(model_type="mistral", attention_bias=True), "attention_bias = True"),
    "qwen_mlp_bias": (dict(model_type="qwen3", mlp_bias=True), "mlp_bias = True"),
    "gemma_local_rope": (dict(model_type="gemma3_text", rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))), "sliding_attention.rope_type = 'linear'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_is_not_built_is_refused_from_the_config_alone(tmp_path, case):
    """The folder holds only config.json: reading any weight would fail another way."""
    changes, named = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps({**hf_config(tiny_args()), **changes}))
    with pytest.raises(ValueError, match="^config.json: .*" + re.escape(named)):
        Transformer.from_pretrained(tmp_path)


def test_each_family_reads_its_options_from_config(tmp_path):
    # Llama's attention_bias puts a bias on o_proj too; Qwen2's biases are on q, k, v only.
    llama = ModelArgs.from_hf_config(hf_config(tiny_args(), attention_bias=True, mlp_bias=True))
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias
    qwen2 = ModelArgs.from_hf_config(hf_config(tiny_args(), "qwen2", sliding_window=8, max_window_layers=1))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None  # use_sliding_window is off
    qwen2 = ModelArgs.from_hf_config(hf_config(tiny_args(), "qwen2", use_sliding_window=True, sliding_window=8,
                                               max_window_layers=1))
    assert qwen2.sliding_window == 8 and qwen2.sliding_layers == (1,)
    # A window as long as the context slides nothing; Phi-3.5 ships one longer than its context.
    assert ModelArgs.from_hf_config(hf_config(tiny_args(), "phi3", sliding_window=4096)).sliding_window is None
    phi = ModelArgs.from_hf_config(hf_config(tiny_args(head_dim=16), "phi3", partial_rotary_factor=0.5,
                                             max_position_embeddings=1024, rope_scaling=LONGROPE))
    assert phi.rotary_dim == 8 and phi.rope_scaling["original_max_position_embeddings"] == 64
    assert phi.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(16) / math.log(64)) ** 0.5)
    cfg = {k: v for k, v in hf_config(tiny_args()).items() if k != "tie_word_embeddings"}  # Gemma ties by default
    gemma = ModelArgs.from_hf_config({**cfg, "model_type": "gemma3_text", "sliding_window": 16,
                                      "rope_local_base_freq": 100.0, "query_pre_attn_scalar": 144})
    assert gemma.sliding_layers == (0, 1) and gemma.local_rope_theta == 100.0 and gemma.attn_scale == 1 / 12
    assert gemma.tie_word_embeddings and gemma.qk_norm and gemma.sandwich_norms and gemma.hidden_act == "gelu_tanh"


def test_positions_past_the_context_are_an_error():
    model = random_model(max_seq_len=16)
    with pytest.raises(ValueError, match="context of 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    model.cache.setup(16)
    with pytest.raises(ValueError, match="position 16 is past the model's context of 16"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([16]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))


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


GEMMA_STOPS = (1, 106)  # <eos>, <end_of_turn>


def test_gemma3_greedy_matches_transformers(gemma3, gemma3_reference):
    # The first prompt is 744 tokens: all 64 generated tokens lie past the 512-token local window.
    assert gemma3.args.sliding_window == 512 and len(gemma3.args.sliding_layers) == 15
    for case in gemma3_reference:
        gen = greedy_decode(gemma3, case["prompt_ids"], len(case["greedy_ids"]), stop_ids=GEMMA_STOPS)
        assert_matches_reference(gen.tokens, case)


def test_gemma3_tokenizer(gemma3_path, gemma3_reference):
    """A byte-fallback BPE over a SentencePiece vocabulary (262k tokens) whose post-processor
    prepends <bos>, unlike SmolLM2's byte-level BPE."""
    tok = Tokenizer.from_pretrained(gemma3_path)
    assert tok.vocab_size == 262144 and set(GEMMA_STOPS) <= set(tok.stop_ids)
    for case in gemma3_reference:
        assert tok.encode(case["prompt"]) == case["prompt_ids"] and case["prompt_ids"][0] == 2
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
    assert any(p == "" for p in pieces)  # some character did committed_range several tokens


# --- the compiled step ------------------------------------------------------------------------

needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile on the CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled_pair():
    """The same tiny float64 model twice: eager, and with every step size up to 8 compiled. Every
    family's options at once (Gemma's window of 5 on layer 0, and Phi-3's partial rotary and
    longrope switch at 24), so the compiled step runs windows and both RoPEs; a cache of 320
    slots, so that a request crosses from reading the first 256 (a bucket) to all 320."""
    options = dict(FAMILY_OPTIONS["gemma"], rotary_dim=4, rope_scaling=FAMILY_OPTIONS["phi3"]["rope_scaling"])
    eager = random_model(seed=9, vocab_size=16, max_seq_len=400, **options)
    compiled = random_model(seed=9, vocab_size=16, max_seq_len=400, **options)
    compiled.compile_steps((1, 2, 4, 8), cache_len=320)  # less than the context: requests must fit it
    return eager, compiled


@pytest.mark.slow
@needs_compiler
def test_compiled_decoding_equals_eager_and_compiles_nothing_after_the_warm_up(compiled_pair, monkeypatch):
    from torch._dynamo.utils import counters
    from decoding import sample_decode
    from engine import generate
    from shape import SourceLedger, StepCosts
    eager, compiled = compiled_pair
    # The ledger weighs each source's measured seconds against the step's, which differ between
    # the two: left out, every step's shape follows from the fixed costs alone.
    monkeypatch.setattr(SourceLedger, "SHARE", float("inf"))
    graphs = counters["stats"]["unique_graphs"]
    costs = StepCosts({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.3})  # a fixed cost model: repeatable shapes
    for prompt, n in (([1, 2, 3, 1, 2, 3, 1, 2], 30), ([5, 6, 7, 8, 9] * 3, 41), ([4], 12), ([3, 1, 4, 1, 5] * 48, 40)):
        runs = [
            lambda m: greedy_decode(m, prompt, n),
            lambda m: generate(m, prompt, n, costs=costs),
            lambda m: generate(m, prompt, n, window=2, ngram=3, candidates=1),  # 7 tokens a step, padded to 8
            lambda m: generate(m, prompt, n, window=1, ngram=3, candidates=1, temperature=0.9, seed=4),
            lambda m: sample_decode(m, prompt, n, temperature=0.9, seed=4),
        ]
        for run in runs:
            want, got = run(eager), run(compiled)
            assert got.tokens == want.tokens and got.committed == want.committed
            # Padding and the bucket's unused slots leave the committed cache as eager's.
            C = len(prompt) + len(want.tokens) - 1
            torch.testing.assert_close(compiled.cache.kv()[..., :C, :], eager.cache.kv()[..., :C, :], rtol=0, atol=1e-10)
    assert counters["stats"]["unique_graphs"] == graphs  # new prompt lengths and lengths: no new graph
    assert any(s.size > 1 + s.guesses + s.window * s.levels
               for s in generate(compiled, [1, 2, 3, 1, 2, 3], 30, window=2, ngram=3, candidates=1).shapes)  # padding ran


@needs_compiler
@pytest.mark.slow
def test_a_compiled_model_keeps_its_cache(compiled_pair):
    _, compiled = compiled_pair
    assert compiled.cache.slots == 320  # what was asked, not the model's context (400)
    with pytest.raises(ValueError, match="needs 340 cache slots and the compiled cache holds 320; load with max_seq_len=340"):
        greedy_decode(compiled, [1] * 300, 41)
    buffers = dict(compiled.named_buffers())  # buffers: their addresses stay fixed for CUDA graphs
    assert all(f"layers.{i}.self_attn.{kv}_cache" in buffers for i in range(2) for kv in "kv")
    with pytest.raises(ValueError, match="compiled"):
        compiled.cache.setup(48)


@pytest.mark.slow
@pytest.mark.parametrize("transposed", [frozenset(), frozenset(range(1, 17))], ids=["as-on-a-gpu", "as-tuned-on-a-cpu"])
def test_the_compiled_step_makes_two_graphs_a_model_whatever_the_size_bucket_or_model(transposed):
    # torch.compile keeps one list of graphs for bucketed_step, shared by every CompiledStep, and
    # with fullgraph=True raises past recompile_limit. Sizes 2 and up must share one graph (size
    # 1 is always its own), whatever the cache bucket a request reads: a guard on the size (as a
    # Linear that tests its token count before its device makes) would spend the allowance on
    # one model's sizes. Counted with the "eager" backend: the same graphs, nothing compiled.
    from torch._dynamo.utils import counters
    from model import STEP_SIZES
    graphs = lambda: counters["stats"]["unique_graphs"]
    # Five shapes in one process (as a fork with a draft model, or .ci/gpu's two curves, has
    # several): ten graphs, past dynamo's default allowance of 8 unless each CompiledStep raises it.
    shapes = (dict(), dict(dim=48, n_heads=6, hidden_dim=96), dict(n_layers=3, vocab_size=40), dict(n_kv_heads=1),
              dict(head_dim=16, hidden_dim=48))
    for seed, shape in enumerate(shapes):
        model = random_model(seed, dtype=torch.float32, max_seq_len=700, **shape)
        for m in model.modules():
            if isinstance(m, Linear):
                m.transposed = transposed
        before = graphs()
        model.compile_steps(STEP_SIZES, cache_len=600, backend="eager")  # buckets 256, 512 and 600
        # At most: a model of a shape compiled before (the other parameter's) may reuse its graphs.
        assert graphs() - before <= 2, f"model {seed + 1}: {graphs() - before} graphs for {len(STEP_SIZES)} sizes"
        compiled = graphs()
        with torch.inference_mode():
            for committed in (10, 300, 590 - STEP_SIZES[-1]):  # the three buckets
                for T in STEP_SIZES:
                    idx = torch.arange(T)[None]
                    C = torch.full((1, 1), committed)
                    model.step(idx % 7, C + idx, C, torch.ones(1, T, T, dtype=torch.bool).tril(), (committed, committed),
                               read=idx)
        for prompt in ([1, 2, 3, 1, 2, 3], [3, 1, 4, 1, 5] * 60):  # requests: both buckets, the engine's own sizes
            greedy_decode(model, prompt, 20)
            generate(model, prompt, 20)
            generate(model, prompt, 20, window=5, ngram=4, candidates=3)
        assert graphs() == compiled, f"model {seed + 1}: requests made {graphs() - compiled} graphs more"


def test_a_compiled_cache_is_what_was_asked_not_the_context():
    # A Llama-3.1-style context of 131,072 positions: the compiled cache holds COMPILED_CACHE slots by
    # default (compiling no size is instant), and max_seq_len where given.
    from model import COMPILED_CACHE
    model = random_model(max_seq_len=131072)
    model.compile_steps(())
    assert model.cache.slots == COMPILED_CACHE == 4096 and model.cache.kv().shape[-2] == 4096 + 1  # a spare slot
    small = random_model(max_seq_len=1024)
    small.compile_steps((), cache_len=300)
    assert small.cache.slots == 300


# --- the model families against transformers --------------------------------------------------
# Tiny random models made by transformers itself (float64), saved as a user's checkpoint would be,
# loaded here. transformers rounds its RMSNorms through float32, so logits agree to ~3e-5, not
# 1e-12; a window one key off moves them by ~1e-1. Windows of 8 keys and a longrope switch at 32
# lie well inside the 100 tokens compared and the 90 of a greedy run.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)
GEMMA3 = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=12, rope_theta=1e5, rope_local_base_freq=100.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
HF_FAMILIES = {
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_gelu": ("LlamaConfig", dict(hidden_act="gelu")),
    "llama3_rope": ("LlamaConfig", dict(rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=16))),
    "mistral_window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(attention_bias=True, head_dim=16)),
    "phi3_longrope": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=32, sliding_window=24,
                                         rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1], long_factor=[2.0, 5.0]))),
    "phi3_plain": ("Phi3Config", dict(head_dim=16, num_key_value_heads=4)),
    "gemma3_text": ("Gemma3TextConfig", dict(GEMMA3, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "gemma3_multimodal": ("Gemma3Config", dict(text_config={**TINY, **GEMMA3}, mm_tokens_per_image=4, image_token_index=63,
                                               boi_token_index=62, eoi_token_index=61,
                                               vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, image_size=28, patch_size=14))),
}


@pytest.fixture(scope="module", params=list(HF_FAMILIES))
def hf_pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from the checkpoint it saved), random float64 weights."""
    import transformers  # the tests' reference only: the library never imports it
    config_class, options = HF_FAMILIES[request.param]
    config = getattr(transformers, config_class)(**options if "text_config" in options else {**TINY, **options})
    torch.manual_seed(0)
    if config_class == "Gemma3Config":
        hf = transformers.Gemma3ForConditionalGeneration(config)
    else:
        hf = transformers.AutoModelForCausalLM.from_config(config)
    hf = hf.to(torch.float64).eval()
    gemma = config_class.startswith("Gemma")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)  # Gemma scales by (1 + w)
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, Transformer.from_pretrained(folder, "cpu", torch.float64)


def test_every_family_matches_transformers_logits(hf_pair):
    hf, ours = hf_pair
    tokens = torch.randint(0, 60, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
    torch.testing.assert_close(ours(tokens), want, rtol=0, atol=1e-4)


def test_every_family_decodes_as_transformers_greedy(hf_pair):
    """90 tokens past windows and the longrope switch, through the cache: greedy as transformers'
    generate, and lookahead (dynamic and fixed) as greedy."""
    hf, ours = hf_pair
    prompt = torch.randint(0, 60, (1, 20), generator=torch.Generator().manual_seed(2))
    want = hf.generate(input_ids=prompt, max_new_tokens=70, min_new_tokens=70, do_sample=False)[0, 20:].tolist()
    assert greedy_decode(ours, prompt[0].tolist(), 70).tokens == want
    assert generate(ours, prompt[0].tolist(), 70).tokens == want
    assert generate(ours, prompt[0].tolist(), 70, window=4, ngram=4, candidates=4).tokens == want


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(list(FAMILY_OPTIONS)), seed=st.integers(0, 2**16), prompt_len=st.integers(1, 30),
       max_new=st.integers(1, 40))
def test_the_cached_steps_are_the_full_forward_at_every_position(family, seed, prompt_len, max_new):
    """Greedy through the KV cache (masked steps, slot positions, the longrope switch) gives at
    every step the argmax of a plain forward over the whole sequence so far: what transformers'
    greedy decoding computes. Lookahead's exactness is checked against greedy elsewhere; this is
    what makes greedy itself right."""
    model = random_model(seed, vocab_size=16, max_seq_len=96, **FAMILY_OPTIONS[family])
    prompt = torch.randint(0, 16, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = greedy_decode(model, prompt, max_new).tokens
    seq = list(prompt)
    for token in got:
        assert int(model(torch.tensor([seq]))[0, -1].argmax()) == token
        seq.append(token)


# --- attention in parts -----------------------------------------------------------------------

def test_attention_split_in_two_parts_and_merged_equals_attention_over_all_keys():
    # The fused kernel's log-sum-exp, plain math's, and their merge: attention over [prefix | own]
    # in two parts equals one softmax over all the keys, also where a query sees no key of a part.
    from attention import attention_with_lse, math_attention, merge
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8, dtype=torch.float64), *torch.randn(2, 2, 3, 12, 8, dtype=torch.float64)
    keep = torch.rand(2, 1, 5, 12) < 0.6
    keep[..., 9:] = True  # every query sees one key of the second part at least
    keep[0, 0, 1, :9] = False  # and query 1 of row 0 none of the first
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    want = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    first = math_attention(q[:, :, None], k[:, :, :9], v[:, :, :9], 8 ** -0.5, keep[:, :, None, :, :9])
    first = first[0][:, :, 0], first[1][:, :, 0]
    assert torch.isinf(first[1][0, :, 1]).all() and (first[0][0, :, 1] == 0).all()
    second = attention_with_lse(q, k[:, :, 9:], v[:, :, 9:], 8 ** -0.5, additive[..., 9:])
    torch.testing.assert_close(merge(first, second), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(merge(second, first), want, rtol=0, atol=1e-12)
    whole, lse = attention_with_lse(q, k, v, 8 ** -0.5, causal=True)  # causal: query i sees keys 0..i
    causal = torch.ones(5, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(whole, scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[..., 0], scores.masked_fill(~causal, float("-inf")).logsumexp(-1), rtol=0, atol=1e-12)


# --- the GPU path, checked on the CPU -------------------------------------------------------------

def test_the_fused_kernels_take_the_arguments_the_code_passes():
    # attention_with_lse calls two private ops positionally; torch >= 2.5 is allowed, so their
    # schemas are pinned here: a renamed or reordered argument fails this test, not a GPU run.
    schema = lambda op: [(a.name, a.kwarg_only) for a in op.default._schema.arguments]
    assert schema(torch.ops.aten._scaled_dot_product_efficient_attention) == [
        ("query", False), ("key", False), ("value", False), ("attn_bias", False), ("compute_log_sumexp", False),
        ("dropout_p", False), ("is_causal", False), ("scale", True)]
    assert [r.name for r in torch.ops.aten._scaled_dot_product_efficient_attention.default._schema.returns][:2] == [
        "output", "log_sumexp"]
    assert schema(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu) == [
        ("query", False), ("key", False), ("value", False), ("dropout_p", False), ("is_causal", False),
        ("attn_mask", True), ("scale", True)]


@pytest.mark.parametrize("shape", [(2, 1, 7, 7), (2, 1, 1, 37), (1, 1, 5, 16)])
def test_the_efficient_kernels_bias_is_aligned_expanded_and_equal(shape):
    from attention import additive, efficient_bias
    mask = torch.randn(shape, dtype=torch.float16)
    bias = efficient_bias(mask, (shape[0], 6, shape[2], shape[3]))
    assert bias.shape == (shape[0], 6, shape[2], shape[3]) and bias.dtype == torch.float16 and bias.stride(-1) == 1
    assert all(s % 16 == 0 for s, n in zip(bias.stride()[:-1], bias.shape[:-1]) if n > 1)  # rows 16-aligned
    assert torch.equal(bias, mask.expand_as(bias))
    # A mask laid out as additive lays it out on a GPU (its last dimension padded to 16, the
    # padding masked) is read in place, the padding left out.
    keep = torch.rand(shape) < 0.7
    padded = additive(keep, torch.float16, padded=True)
    assert padded.shape[-1] == -(-shape[-1] // 16) * 16 and bool((padded[..., shape[-1]:] == float("-inf")).all())
    bias = efficient_bias(padded, (shape[0], 6, shape[2], shape[3]))
    assert bias.data_ptr() == padded.data_ptr()
    assert torch.equal(bias, additive(keep, torch.float16, padded=False).expand_as(bias))


@pytest.mark.slow
def test_the_cuda_attention_branch_on_meta_tensors_compiles_one_graph_for_every_step_size_and_width(monkeypatch):
    # The CUDA branch of a step's attention as a compiled step runs it (Attention.attend through
    # the memory-efficient kernel, efficient_attention_op), on meta tensors: grouped heads (g =
    # 4), a (B, 1, g*T, T) mask (the g heads of a K/V head folded into one query) and the
    # committed prefix's (B, 1, 1, S), both laid out as additive lays them out on a GPU. The
    # kernel pads lse's rows to 32 and the masks' to 16: sliced in the graph, each padding made
    # a graph of its own (an H200 compiled sizes 1, 4 and 16 apart, 60-100 s each). One graph
    # must serve every step size from 2 and two cache widths.
    import attention
    import model as model_module
    from torch._dynamo.testing import CompileCounterWithBackend
    monkeypatch.setattr(model_module, "attention_with_lse", lambda q, k, v, scale, mask=None, causal=False:
                        attention.efficient_attention_op(q, k, v, mask, scale, causal))
    # Sizes no step size equals (3 K/V heads of 72): as graph inputs here, not a model's static
    # weights, a dimension equal to T would be tied to it (dynamo's duck sizing).
    args = tiny_args(n_heads=12, n_kv_heads=3, head_dim=72)
    with torch.device("meta"):
        attn = model_module.Attention(args)
        attn.k_cache, attn.v_cache = torch.empty(1, 3, 600, 72), torch.empty(1, 3, 600, 72)
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, keep, seen):  # as step_masks builds the masks on a GPU; the width a graph argument, as CompiledStep passes it
        own = attention.additive(keep.repeat(1, 4, 1), torch.float32, padded=True)[:, None]  # (1, 1, 4T, T padded)
        prefix = attention.additive(seen, torch.float32, padded=True)[:, None, None]  # (1, 1, 1, S padded)
        return attn.attend(q, k, v, own, (0, seen.shape[-1], prefix), slice(0, 1))

    attend = torch.compile(step, backend=counter, dynamic=True, fullgraph=True)
    m = lambda *s: torch.empty(*s, device="meta")
    first = 0
    for S in (300, 520):
        for T in (2, 4, 8, 16, 32, 64, 128):
            out = attend(m(1, 12, T, 72), m(1, 3, T, 72), m(1, 3, T, 72),
                         torch.ones(1, T, T, dtype=torch.bool, device="meta"), torch.ones(1, S, dtype=torch.bool, device="meta"))
            assert out.shape == (1, 12, T, 72)
            first = first or counter.frame_count
    assert counter.frame_count == first  # what the first call compiled served every other


class Reached(Exception):
    pass


@pytest.mark.parametrize("dtype,cuda,native_bf16,message", [
    (torch.bfloat16, True, False, r"compute capability 7\.5\) has no native bfloat16"),
    (torch.float32, False, False, "sees no CUDA GPU"),
    (torch.bfloat16, True, True, None), (torch.float16, True, False, None), (torch.float64, True, False, None),
])
def test_a_dtype_the_gpu_cannot_run_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, dtype, cuda,
                                                                         native_bf16, message):
    # A T4 (7.5): torch emulates bfloat16 there (is_bf16_supported() says yes), the fused kernels
    # have none. float16 and float64 (plain-math attention on a GPU) run: they reach the weights.
    import model as model_module
    folder = write_checkpoint(tmp_path / "tiny", random_model(seed=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or native_bf16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if native_bf16 else (7, 5))

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(model_module, "read_weights", reached)
    with pytest.raises(ValueError if message else Reached, match=message):
        Transformer.from_pretrained(folder, device="cuda", dtype=dtype)


def test_a_float64_prompt_in_chunks_through_plain_attention_is_the_same_as_whole(monkeypatch):
    # A GPU runs float64 through plain-math attention (plain_attention_with_lse); a prompt's
    # chunk after the first is causal over itself beside the cache. Forced onto that path on the
    # CPU, a prompt in chunks of 7 gives the logits of the prompt run whole.
    import attention
    import decoding
    import model as model_module
    model = random_model(seed=3, vocab_size=16)
    prompt = [int(t) for t in torch.randint(0, 16, (30,), generator=torch.Generator().manual_seed(3))]
    decoding.ensure_cache(model, 64, 1)
    whole = decoding.prefill(model, [prompt])
    monkeypatch.setattr(model_module, "attention_with_lse", attention.plain_attention_with_lse)
    monkeypatch.setattr(decoding, "PREFILL_CHUNK", 7)
    chunked = decoding.prefill(model, [prompt])
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10)
